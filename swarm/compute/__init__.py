"""swarm.compute — the numpy inference engine.

Model files (GGUF, HF safetensors), the forward pass with an explicit KV cache, sampling,
and the FFN seam (:mod:`swarm.compute.ffn`) through which the swarm computes MLP / MoE
outputs on other peers.
"""

from swarm.compute.config import ModelConfig
from swarm.compute.ffn import (FFNBackend, LayerBackend, LocalFFN, Routing, RoutingConfig, check_dense_plan,
                               combine, dense_partial, swiglu_ffn, expert_rows, route,
                               shared_expert, sum_partials)
from swarm.compute.kernels import MLPWeights
from swarm.compute.model import KVCache, Model, load_model
from swarm.compute.sampling import SamplingParams, generate, sample

__all__ = [
    "FFNBackend", "KVCache", "LayerBackend", "LocalFFN", "MLPWeights", "Model", "ModelConfig", "Routing",
    "RoutingConfig", "SamplingParams", "check_dense_plan", "combine", "dense_partial",
    "swiglu_ffn", "expert_rows", "generate", "load_model", "route", "sample", "shared_expert",
    "sum_partials",
]
