"""``asyncllm.integrations``: asyncllm inside other frameworks.

Each integration imports its framework only when it is used, so a plain install can import this
package; a missing framework is an ``ImportError`` that names the extra to install.

- ``asyncllm.integrations.ray_serve``: the OpenAI app as a Ray Serve deployment, its replicas
  scaled and healed by Serve (``pip install 'asyncllm[ray]'``; docs/scale-out.md).
"""

from __future__ import annotations
