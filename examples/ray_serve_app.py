"""Ray Serve: asyncllm's OpenAI-compatible app on replicas that Serve adds and removes with the load.

    pip install 'asyncllm[ray]'
    cd examples && serve run ray_serve_app:app    # Serve's CLI; or: python examples/ray_serve_app.py
    curl localhost:8000/v1/models

Each replica is a process with its own engine, opened when the replica starts. Serve's HTTP proxy
(port 8000) sends each request to a replica; requests that carry an ``x-session-id`` header go to the
same replica every time, so a conversation's growing prompt stays in that replica's prefix cache.
ASYNCLLM_MODEL picks the model folder (default: SmolLM2-135M-Instruct); every node needs it.
See docs/scale-out.md.
"""

from __future__ import annotations

import os

from asyncllm.integrations.ray_serve import openai_app

app = openai_app(
    os.environ.get("ASYNCLLM_MODEL"),
    engine_options={"max_num_seqs": 32},  # each replica takes 32 requests at once; Serve queues the rest
    # One to four replicas: Serve adds one when the replicas average more than 16 requests (half a batch).
    autoscaling_config={"min_replicas": 1, "max_replicas": 4},
    ray_actor_options={"num_cpus": 2},  # on GPUs: {"num_gpus": 1}
    session_affinity=True,
)


if __name__ == "__main__":
    from ray import serve

    serve.run(app, route_prefix="/", blocking=True)  # starts a local Ray cluster; Ctrl-C stops it
