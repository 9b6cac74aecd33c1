"""The ``torch`` attention backend: the reference (explicit slots and masks, SDPA), on any device."""
