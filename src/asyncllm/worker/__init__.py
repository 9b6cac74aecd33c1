"""The worker and model runner: ``TorchModelRunner`` (load, KV cache, step), the persistent input
batch, the batched sampler, CUDA graphs, ``torch.compile``, memory sizing and weight loading."""
