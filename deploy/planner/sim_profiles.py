"""Named simulated-node profiles: a model on a GPU deployment, so simulated nodes
stand for real ones (``splitserve sim-nodes --profile NAME``, ``replay --profile``,
``--list-profiles``), and deployments: prefill nodes of one profile, decode nodes of
another (``replay --profile DEPLOYMENT``).

Owns reading ``sim_profiles.toml`` (next to this file; the numbers, their sources
and their calibration state live there) and deriving from it, for a node of
``gpus`` tensor-parallel ranks (weights and KV sharded Megatron-style, by heads):

    kv_bytes_per_token = 2 (K, V) x layers x max(kv_heads, gpus) x head_dim x dtype_bytes
                         (gpus > kv_heads: each rank holds a replica of one KV head)
    weight_bytes       = parameters x dtype_bytes
    kv_pool_bytes      = gpus x memory x utilization - weight_bytes - gpus x activation
    kv_pool_tokens     = kv_pool_bytes // kv_bytes_per_token (whole blocks)
    timing             = deploy/planner/roofline.py with flops = 2 x (parameters - vocab x hidden),
                         peak x flops_efficiency x gpus (x tp_efficiency when gpus > 1),
                         bandwidth x bandwidth_efficiency x gpus (same), step overhead
                         (a CPU profile keeps SimConfig's fitted timing instead)
    kv_network         = the [network.NAME] a prefill node's KV leaves over: its bytes_per_s
                         x gpus (one link per GPU) and its latency_s (none on the CPU: a
                         transfer then takes what this machine's transport takes)
    host / disk tier   = host_tier_pools / disk_tier_pools x kv_pool_bytes, moved at the
                         hardware's host_bytes_per_s / disk_read_bytes_per_s /
                         disk_write_bytes_per_s x gpus

A Mixture-of-Experts model (``num_experts``, ``experts_per_token`` = k,
``moe_intermediate``; ``dense_layers`` leading layers without experts, default 0;
``active_parameters`` from the model card, checked against the derived figure within
ACTIVE_TOLERANCE) splits its parameters into routed experts and the dense rest
(attention, embeddings, norms, routers, any shared experts)::

    expert_params      = 3 x hidden x moe_intermediate           (gate, up, down: one expert, one layer)
    routed             = (layers - dense_layers) x num_experts x expert_params
    active_parameters  = parameters - routed + (layers - dense_layers) x k x expert_params
    flops              = 2 x (active_parameters - vocab x hidden) per token (+ attention)
    bytes read a step  = (parameters - routed) x dtype_bytes
                         + E x (1 - (1 - k/E)^T) x (layers - dense_layers) x expert_params x dtype_bytes
                         (T new tokens of the step; roofline.expected_experts)

and a profile's ``ep`` (expert-parallel groups, dividing ``gpus``; the engine's
--enable-expert-parallel makes it ``gpus``) gives each GPU E/ep whole experts (each cut
over gpus/ep ranks; ep = 1: a 1/gpus slice of every expert, like a dense MLP) and
adds an all-to-all per MoE layer over the hardware's ``interconnect`` (a
[network.NAME]): 2 x T x k x hidden x dtype_bytes x (ep - 1)/ep bytes spread over the ep
ranks' links, plus its latency per dispatch and combine (roofline.MoeCost). Attention
stays tensor-parallel over the node's GPUs either way, so the KV is the same.

A Multi-head Latent Attention model (DeepSeek-V3's: ``kv_lora_rank``, ``qk_rope_head_dim``,
``qk_nope_head_dim``, ``v_head_dim``; optional ``q_lora_rank``; no ``kv_heads`` or
``head_dim``) caches one latent per token and layer, shared by every head::

    kv_bytes_per_token = layers x (kv_lora_rank + qk_rope_head_dim) x dtype_bytes x tp
                         (61 x 576 x 2 = 70,272 B for DeepSeek-V3 in bf16; tp > 1: a latent has
                         no heads to split, so every tensor-parallel rank holds a replica)
    attn_flops         = 2 x layers x heads x (qk_nope + qk_rope + v_head_dim)
                         (per new token per context token: keys and values expanded per
                         head, as a prefill chunk computes them)

A profile's ``dp`` (data-parallel attention, the engine's --data-parallel-size; a MoE
model, dp = gpus = ep) makes the node ``gpus`` ranks of one GPU each, every rank with its
own requests, scheduler and KV pool and E/dp experts whole. The engine registers each rank
as a node of its pool, so a simulated node of a DP profile is ONE RANK (``node_gpus`` =
gpus / dp = 1): its KV pool is one GPU's memory less the rank's weights
(``weight_bytes`` = dense part + routed / dp), and its step is one GPU's roofline of its
own T tokens reading the dense part and its share of the experts touched by all dp ranks'
tokens, plus the engine's all_gather + all_reduce over the dp ranks (roofline.MoeCost,
``dp``). The other ranks are taken as evenly loaded (T tokens each): the simulation runs
each rank's scheduler alone. The engine pads every rank's rows to the busiest rank's, so
the collective's bytes are exact for the busiest rank and under-priced for the others;
an idle rank's empty turns in the collective are not priced. The collective's link is the hardware's
``interconnect`` while dp <= its ``gpus_per_host`` (default 8), else its ``scale_out``
network (a DP node spanning hosts: the ring's slowest hop). A pool of DP nodes grows by
whole nodes (``splitserve plan`` counts nodes of dp ranks).

``weight_bytes_per_param`` (default dtype_bytes) prices weights in another dtype than the
KV and activations: 1 for FP8 weights (DeepSeek-V3's published checkpoint). A profile
whose weights alone exceed its GPUs' memory x utilization is refused, saying how much each
GPU would hold.

A deployment's two profiles must hold the same KV (model, dtype, block size); their
TP degrees, EP sizes and hardware may differ.

Must not import torch or node code; a bad profile or deployment raises ValueError
naming it.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ...common.config import SimConfig
from .roofline import MoeCost, Roofline

PROFILES_FILE = Path(__file__).with_name("sim_profiles.toml")
GIB = 1 << 30
DENSE_FIELDS = ("parameters", "layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "context")
MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")  # all or none
MLA_OPTIONAL = ("q_lora_rank",)
MOE_FIELDS = ("num_experts", "experts_per_token", "moe_intermediate")  # all or none
MOE_OPTIONAL = ("dense_layers", "active_parameters")
ACTIVE_TOLERANCE = 0.03  # a stated active_parameters within 3% of the derived one


@dataclass(frozen=True, slots=True)
class SimProfile:
    name: str
    model: str
    hardware: str
    gpus: int  # GPUs of one node (tensor-parallel ranks, or data-parallel ranks with dp); 0: the CPU
    dtype_bytes: int  # of weights and KV
    context: int  # max model length, tokens
    block_size: int
    kv_bytes_per_token: int
    weight_bytes: int
    kv_pool_bytes: int
    prefill_chunk_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    calibrated: bool
    roofline: Roofline | None  # None: SimConfig's fitted CPU timing
    kv_network: str = ""  # the [network.NAME] between prefill and decode nodes; "": not modelled
    kv_network_bytes_per_s: float = 0.0  # the node's links together (the network's rate x gpus)
    kv_network_latency_s: float = 0.0
    host_tier_bytes: int = 0  # the prefix cache's host-memory tier when a run turns it on
    disk_tier_bytes: int = 0  # and its disk tier
    host_bytes_per_s: float = 0.0  # host memory <-> KV pool, each direction, the node's GPUs together
    disk_read_bytes_per_s: float = 0.0  # disk -> host memory
    disk_write_bytes_per_s: float = 0.0  # host memory -> disk
    layers: int = 0  # the model's decoder layers (a lower-tier load overlaps a forward layer by layer); 0: the folder's
    ep: int = 1  # expert-parallel ranks (a MoE model; 1: experts tensor-parallel like a dense MLP)
    num_experts: int = 0  # routed experts per MoE layer; 0: a dense model
    experts_per_token: int = 0  # k of them per token
    active_parameters: float = 0.0  # a MoE's per token (derived); a dense model's: all
    expert_weight_bytes: int = 0  # the routed experts' weights on a simulated node (part of weight_bytes)
    dp: int = 1  # data-parallel ranks of the node; > 1: a simulated node is one of them (one GPU)
    weight_bytes_per_param: float = 0.0  # the weights' dtype (0: dtype_bytes)
    mla: bool = False  # the model caches a latent per token (Multi-head Latent Attention)

    @property
    def node_gpus(self) -> int:
        """GPUs one simulated node stands for: the node's (TP), one (a DP rank), 0 on the CPU."""
        return self.gpus // self.dp

    @property
    def weight_bytes_per_gpu(self) -> int:
        return self.weight_bytes // max(self.node_gpus, 1)

    @property
    def experts_per_gpu(self) -> int:
        """Routed experts each GPU holds weights of: E / ep (whole ones when ep = gpus, a
        1/gpus slice of each of the E under ep = 1)."""
        return self.num_experts // self.ep

    @property
    def expert_bytes_per_gpu(self) -> int:
        """Routed-expert weight bytes on each GPU (EP, TP or a DP rank alike)."""
        return self.expert_weight_bytes // max(self.node_gpus, 1)

    @property
    def kv_pool_tokens(self) -> int:
        return self.kv_pool_bytes // (self.kv_bytes_per_token * self.block_size) * self.block_size

    @property
    def block_bytes(self) -> int:
        """One KV block of the modelled model (all layers, K and V, every rank's heads)."""
        return self.kv_bytes_per_token * self.block_size

    def sim_config(self, speedup: float = 1.0) -> SimConfig:
        return SimConfig(speedup=speedup, roofline=self.roofline, max_model_len=self.context,
                         kv_bytes_per_token=self.kv_bytes_per_token,
                         kv_network_bytes_per_s=self.kv_network_bytes_per_s,
                         kv_network_latency_s=self.kv_network_latency_s,
                         host_bytes_per_s=self.host_bytes_per_s, disk_read_bytes_per_s=self.disk_read_bytes_per_s,
                         num_layers=self.layers)

    def prefill_seconds(self, tokens: int, cached: int = 0) -> float:
        """One request's prompt of ``tokens``, ``cached`` of them already in the node's
        cache, alone on the node, in chunks."""
        sim, t, done = self.sim_config(), 0.0, cached
        while done < tokens:
            n = min(self.prefill_chunk_size, tokens - done)
            t += sim.step_seconds(0, [(n, done)])
            done += n
        return t

    def policy_weights(self) -> dict[str, float]:
        """cache_aware's weights that describe this deployment (router/config.py
        CacheAwareWeights): ``attention``, the roofline's attention FLOPs per new x context
        token over its FLOPs per token, and ``token_s``, the compute-bound seconds per prompt
        token. Empty without a roofline (the defaults are this CPU's fit)."""
        r = self.roofline
        if r is None:
            return {}
        return {"attention": r.attn_flops / r.flops_per_token, "token_s": r.flops_per_token / r.flops_per_s}

    def summary(self) -> dict:
        sim = self.sim_config()
        return {
            "profile": self.name, "model": self.model, "hardware": self.hardware, "gpus": self.gpus,
            "ep": self.ep, "dp": self.dp, "node_gpus": self.node_gpus, "mla": self.mla,
            "weight_bytes_per_param": self.weight_bytes_per_param or self.dtype_bytes,
            "weight_gib_per_gpu": round(self.weight_bytes_per_gpu / GIB, 2),
            "num_experts": self.num_experts, "experts_per_token": self.experts_per_token,
            "active_parameters": self.active_parameters,
            "context": self.context, "block_size": self.block_size,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "weight_gib": round(self.weight_bytes / GIB, 2),
            "kv_pool_gib": round(self.kv_pool_bytes / GIB, 2), "kv_pool_tokens": self.kv_pool_tokens,
            "prefill_8k_s": round(self.prefill_seconds(8192), 3),
            "prefill_32k_s": round(self.prefill_seconds(min(32768, self.context - 1)), 3),
            "decode_step_b32_ctx8k_ms": round(sim.step_seconds(32, [], 32 * 8192) * 1000, 2),
            "kv_network": self.kv_network, "kv_network_gb_per_s": self.kv_network_bytes_per_s / 1e9,
            "kv_network_latency_us": round(self.kv_network_latency_s * 1e6, 1),
            "transfer_16k_ms": round(sim.transfer_seconds(-(-16384 // self.block_size), self.block_size) * 1000, 2),
            "host_tier_gib": round(self.host_tier_bytes / GIB, 1), "host_gb_per_s": self.host_bytes_per_s / 1e9,
            "disk_tier_gib": round(self.disk_tier_bytes / GIB, 1),
            "disk_read_gb_per_s": self.disk_read_bytes_per_s / 1e9,
            "disk_write_gb_per_s": self.disk_write_bytes_per_s / 1e9,
            "calibrated": self.calibrated,
        }


@dataclass(frozen=True, slots=True)
class SimDeployment:
    """Prefill nodes of one profile, decode nodes of another (one profile for both
    when ``name`` is a profile's). Built by ``pair``, which refuses two profiles whose
    KV differs."""
    name: str
    prefill: SimProfile
    decode: SimProfile

    @property
    def context(self) -> int:
        return self.prefill.context  # the same model: the same context

    def policy_weights(self) -> dict[str, float]:
        """cache_aware's weights for this deployment: the prefill profile's. Every weight
        is in token-equivalents of a prefill node (1.0 = its time to prefill one prompt
        token), so ``token_s`` is the prefill profile's; ``attention`` is a ratio of the
        model's FLOPs, the same in both. The decode terms need no weight from the decode
        profile: they count the requests on each decode node and the fraction of its own
        KV pool in use (the decode profile's pool: under TP8 the same requests fill less
        of it), and the pair cost is a prefill term plus a decode term, so the decode
        nodes' speed cannot change which prefill node wins. One cost is priced at the
        prefill profile's speed when the profiles differ: a decode node prefilling
        alone (``local_prefill_tokens`` > 0, off by default)."""
        return self.prefill.policy_weights()

    def describe(self) -> str:
        if self.prefill is self.decode:
            return f"{self.name}: prefill and decode nodes {self.prefill.name} ({_layout(self.prefill)})"
        return (f"{self.name}: prefill nodes {self.prefill.name} ({_layout(self.prefill)}), "
                f"decode nodes {self.decode.name} ({_layout(self.decode)})")


def _layout(p: SimProfile) -> str:
    if p.dp > 1:
        return f"DP{p.dp}/EP{p.ep}"
    return f"TP{p.gpus}" + (f"/EP{p.ep}" if p.ep > 1 else "")


def pair(name: str, prefill: SimProfile, decode: SimProfile) -> SimDeployment:
    """``prefill`` nodes sending KV to ``decode`` nodes; ValueError when the KV one
    computes is not the KV the other holds (model, dtype, block size)."""
    for field, a, b in (("model", prefill.model, decode.model), ("dtype_bytes", prefill.dtype_bytes,
                        decode.dtype_bytes), ("block_size", prefill.block_size, decode.block_size)):
        if a != b:
            raise ValueError(f"deployment {name}: prefill profile {prefill.name} and decode profile "
                             f"{decode.name} differ in {field} ({a!r} vs {b!r}), so the decode nodes "
                             f"cannot hold the prefill nodes' KV; pair profiles of the same model, "
                             f"dtype and block size (their TP and hardware may differ)")
    return SimDeployment(name, prefill, decode)


def load_profiles(path: str | Path = PROFILES_FILE) -> dict[str, SimProfile]:
    """Every profile of ``path``, derived; ValueError naming the profile and field."""
    return _load(path)[0]


def load_deployments(path: str | Path = PROFILES_FILE) -> dict[str, SimDeployment]:
    """Every ``[deployment.NAME]`` of ``path`` (``prefill = PROFILE``, ``decode = PROFILE``),
    checked by ``pair``."""
    return _load(path)[1]


def get_profile(name: str, path: str | Path = PROFILES_FILE) -> SimProfile:
    profiles, deployments = _load(path)
    if name in deployments:
        d = deployments[name]
        raise ValueError(f"profile: {name!r} is a deployment of two profiles ({d.describe()}); start "
                         f"its prefill nodes with --profile {d.prefill.name} and its decode nodes with "
                         f"--profile {d.decode.name}, or give it to replay --profile")
    if name not in profiles:
        raise ValueError(f"profile: unknown simulated-node profile {name!r}; one of "
                         f"{', '.join(sorted(profiles))} (splitserve sim-nodes --list-profiles)")
    return profiles[name]


def get_deployment(name: str, path: str | Path = PROFILES_FILE) -> SimDeployment:
    """The deployment ``name``, or the profile ``name`` on prefill and decode nodes alike."""
    profiles, deployments = _load(path)
    if name in deployments:
        return deployments[name]
    if name in profiles:
        return SimDeployment(name, profiles[name], profiles[name])
    raise ValueError(f"profile: unknown simulated-node profile or deployment {name!r}; one of "
                     f"{', '.join(sorted(profiles) + sorted(deployments))} (splitserve sim-nodes --list-profiles)")


def format_profiles(profiles: dict[str, SimProfile], deployments: dict[str, SimDeployment] | None = None) -> str:
    """The table of ``profiles``, then the deployments (None: those of PROFILES_FILE)."""
    head = (f"{'profile':26} {'TP':>2} {'DP':>2} {'EP':>2} {'ctx':>7} {'KV B/tok':>9} {'weights':>9} {'KV pool':>9} "
            f"{'pool tokens':>12} {'prefill 8k':>10} {'32k':>8} {'decode b32':>10}  calibrated")
    lines = [head]
    for p in profiles.values():
        s = p.summary()
        lines.append(f"{p.name:26} {p.node_gpus:>2} {p.dp:>2} {p.ep:>2} {p.context:>7} {p.kv_bytes_per_token:>9} "
                     f"{s['weight_gib']:>6.1f}GiB {s['kv_pool_gib']:>6.1f}GiB {p.kv_pool_tokens:>12} "
                     f"{s['prefill_8k_s']:>9.3f}s {s['prefill_32k_s']:>7.3f}s "
                     f"{s['decode_step_b32_ctx8k_ms']:>8.2f}ms  {'yes' if p.calibrated else 'no (stated)'}")
    lines.append("decode b32: one step of 32 requests with 8k tokens of context each. A DP profile's row is "
                 "one rank (one GPU: its weights, its KV pool, its step with the collective over dp ranks).")
    lines.append(f"{'profile':26} {'KV network':>11} {'GB/s':>6} {'move 16k':>9} {'host tier':>10} {'GB/s':>6} "
                 f"{'disk tier':>10} {'read/write GB/s':>16}")
    for p in profiles.values():
        s = p.summary()
        net = (f"{p.kv_network:>11} {s['kv_network_gb_per_s']:>6g} {s['transfer_16k_ms']:>7.1f}ms"
               if p.kv_network else f"{'-':>11} {'-':>6} {'host':>9}")
        tiers = (f"{s['host_tier_gib']:>7.0f}GiB {s['host_gb_per_s']:>6g} {s['disk_tier_gib']:>7.0f}GiB "
                 f"{s['disk_read_gb_per_s']:>7g} / {s['disk_write_gb_per_s']:<6g}" if p.host_tier_bytes else
                 f"{'-':>10} {'-':>6} {'-':>10} {'-':>16}")
        lines.append(f"{p.name:26} {net} {tiers}")
    lines.append("move 16k: a prefill node's transfer of 16k tokens' KV to a decode node that holds none "
                 "of it (host: what this machine's transport takes); tiers: the prefix cache's host "
                 f"memory and disk, sized in KV pools. Numbers and their sources: {PROFILES_FILE}")
    for d in (load_deployments() if deployments is None else deployments).values():
        lines.append(f"deployment {d.describe()}")
    return "\n".join(lines)


def _load(path: str | Path) -> tuple[dict[str, SimProfile], dict[str, SimDeployment]]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"sim profiles: cannot read {path}: {e}") from None
    for name, m in data.get("model", {}).items():
        _check_model(name, m)
    profiles = {name: _derive(name, p, data) for name, p in data.get("profile", {}).items()}
    deployments: dict[str, SimDeployment] = {}
    for name, d in data.get("deployment", {}).items():
        roles = {role: d.get(role) for role in ("prefill", "decode")}
        for role, profile in roles.items():
            if profile not in profiles:
                raise ValueError(f"deployment {name}: {role} = {profile!r} is no profile of {path}; "
                                 f"one of {', '.join(sorted(profiles))}")
        if name in profiles:
            raise ValueError(f"deployment {name}: a profile has that name; name it apart")
        deployments[name] = pair(name, profiles[roles["prefill"]], profiles[roles["decode"]])
    return profiles, deployments


def _derive(name: str, p: dict, data: dict) -> SimProfile:
    where = f"profile {name}"
    try:
        m = data["model"][p["model"]]
        hw = data["hardware"][p["hardware"]]
        dtype = p["dtype_bytes"]
        gpus = p["gpus"]
        ep, dp = p.get("ep", 1), p.get("dp", 1)
        wbytes = p.get("weight_bytes_per_param", dtype)
        if isinstance(wbytes, bool) or not isinstance(wbytes, (int, float)) or wbytes <= 0:
            raise ValueError(f"{where}: weight_bytes_per_param = {wbytes!r} must be a number > 0 (1: FP8)")
        shape = _moe_shape(m)
        _check_ep(where, ep, gpus, shape)
        _check_dp(where, dp, gpus, ep, shape)
        ranks = gpus // dp  # GPUs of one simulated node: the node's (TP), 1 (a DP rank)
        mla = "kv_lora_rank" in m
        if mla:
            if ranks and m["heads"] % ranks:
                raise ValueError(f"{where}: {m['heads']} query heads do not split over {ranks} ranks")
            kv_tok = m["layers"] * (m["kv_lora_rank"] + m["qk_rope_head_dim"]) * dtype * max(ranks, 1)
            attn = 2 * m["layers"] * m["heads"] * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"] + m["v_head_dim"])
        else:
            if ranks and (m["heads"] % ranks or (m["kv_heads"] % ranks and ranks % m["kv_heads"])):
                raise ValueError(f"{where}: {m['heads']} query and {m['kv_heads']} KV heads do not split over "
                                 f"{ranks} ranks; use a TP degree that divides the query heads and divides "
                                 f"or is a multiple of the KV heads")
            kv_heads = max(m["kv_heads"], ranks)  # TP > KV heads: every rank holds one head's replica
            kv_tok = 2 * m["layers"] * kv_heads * m["head_dim"] * dtype
            attn = 4 * m["layers"] * m["heads"] * m["head_dim"]
        active, routed = (shape.active, shape.routed) if shape else (m["parameters"], 0)
        weights = int((m["parameters"] - routed + routed / dp) * wbytes)  # a DP rank: dense + its experts
        if gpus:
            pool = int(ranks * hw["memory_gib"] * GIB * p["gpu_memory_utilization"]
                       - weights - ranks * p["activation_gib"] * GIB)
            if weights >= ranks * hw["memory_gib"] * GIB * p["gpu_memory_utilization"]:
                raise ValueError(f"{where}: its weights do not fit: {weights / ranks / 1e9:.0f} GB per GPU "
                                 f"({wbytes:g} bytes a parameter) against {hw['memory_gib']:g} GiB x "
                                 f"{p['gpu_memory_utilization']:g}; spread them over more GPUs (ep, dp) or "
                                 f"price smaller weights (weight_bytes_per_param = 1 for FP8)")
            scale = ranks * (hw["tp_efficiency"] if ranks > 1 else 1.0)
            roofline = Roofline(
                flops_per_token=2 * (active - m["vocab"] * m["hidden"]),
                attn_flops=attn,
                weight_bytes=(m["parameters"] - routed) * wbytes if shape else weights, kv_bytes_per_token=kv_tok,
                flops_per_s=hw["peak_bf16_flops"] * hw["flops_efficiency"] * scale,
                bytes_per_s=hw["hbm_bytes_per_s"] * hw["bandwidth_efficiency"] * scale,
                step_overhead_s=hw["step_overhead_s"],
                moe=_moe_cost(where, shape, ep, dp, m["hidden"], dtype, wbytes, hw, data) if shape else None)
        else:
            pool, roofline = int(p["kv_cache_gib"] * GIB), None
        links = max(ranks, 1)  # one network link, PCIe link and drive per GPU
        net_name = p.get("kv_network", "")
        if net_name and net_name not in data.get("network", {}):
            raise ValueError(f"{where}: kv_network = {net_name!r} is no [network.NAME] of the file; one of "
                             f"{', '.join(sorted(data.get('network', {})))}")
        net = data["network"][net_name] if net_name else {"bytes_per_s": 0.0, "latency_s": 0.0}
        host_pools, disk_pools = p.get("host_tier_pools", 0.0), p.get("disk_tier_pools", 0.0)
        if host_pools < 0 or disk_pools < 0 or (disk_pools and not host_pools):
            raise ValueError(f"{where}: host_tier_pools and disk_tier_pools must be >= 0, and a disk tier "
                             f"needs a host tier (blocks reach the disk through host memory)")
        tier_rates = {k: (hw[k] * links if host_pools else 0.0)
                      for k in ("host_bytes_per_s", "disk_read_bytes_per_s", "disk_write_bytes_per_s")}
        prof = SimProfile(name=name, model=p["model"], hardware=p["hardware"], gpus=gpus, dtype_bytes=dtype,
                          context=m["context"],
                          block_size=p["block_size"], kv_bytes_per_token=kv_tok, weight_bytes=weights,
                          kv_pool_bytes=pool, prefill_chunk_size=p["prefill_chunk_size"],
                          max_num_batched_tokens=p["max_num_batched_tokens"],
                          max_num_seqs=p["max_num_seqs"], calibrated=bool(hw["calibrated"]),
                          roofline=roofline, kv_network=net_name,
                          kv_network_bytes_per_s=net["bytes_per_s"] * links, kv_network_latency_s=net["latency_s"],
                          host_tier_bytes=int(pool * host_pools), disk_tier_bytes=int(pool * disk_pools),
                          layers=m["layers"], ep=ep, num_experts=shape.experts if shape else 0,
                          experts_per_token=shape.top_k if shape else 0, active_parameters=active,
                          expert_weight_bytes=int(routed / dp * wbytes), dp=dp,
                          weight_bytes_per_param=wbytes, mla=mla, **tier_rates)
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e}") from None
    if prof.kv_pool_tokens < prof.context:
        raise ValueError(f"{where}: its KV pool holds {prof.kv_pool_tokens} tokens, less than one "
                         f"context of {prof.context}; lower the weights or raise the memory")
    return prof


class MoeShape(NamedTuple):
    """A MoE model's routed experts, from its [model.NAME] (module docstring)."""
    experts: int
    top_k: int
    moe_layers: int
    expert_params: int  # one expert in one layer
    routed: float  # parameters of all routed experts
    active: float  # parameters a token runs through


def _check_model(name: str, m: dict) -> None:
    """ValueError naming the field of [model.NAME] that is unknown or invalid."""
    where = f"model {name}"
    known = DENSE_FIELDS + MOE_FIELDS + MOE_OPTIONAL + MLA_FIELDS + MLA_OPTIONAL
    for key in m:
        if key not in known:
            raise ValueError(f"{where}: unknown field {key!r}; the fields are {', '.join(known)}")
    _check_mla(where, m)
    given = [k for k in MOE_FIELDS if k in m]
    if given and len(given) < len(MOE_FIELDS) or not given and any(k in m for k in MOE_OPTIONAL):
        missing = [k for k in MOE_FIELDS if k not in m]
        raise ValueError(f"{where}: missing field {missing[0]!r}; a MoE model states all of "
                         f"{', '.join(MOE_FIELDS)}")
    for key in given + [k for k in MOE_OPTIONAL if k in m]:
        v, low = m[key], 0 if key == "dense_layers" else 1
        if key == "active_parameters":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{where}: {key} = {v!r} must be a number > 0")
        elif isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{where}: {key} = {v!r} must be a whole number >= {low}")
    if not given:
        return
    for key in ("parameters", "layers", "hidden"):
        if key not in m:
            raise ValueError(f"{where}: missing field {key!r}")
    if m["experts_per_token"] > m["num_experts"]:
        raise ValueError(f"{where}: experts_per_token = {m['experts_per_token']} exceeds num_experts = "
                         f"{m['num_experts']}")
    if m.get("dense_layers", 0) >= m["layers"]:
        raise ValueError(f"{where}: dense_layers = {m['dense_layers']} leaves no MoE layer of {m['layers']}")
    shape = _moe_shape(m)
    assert shape is not None, "the MoE fields are given"
    if shape.active <= 0 or shape.routed >= m["parameters"]:
        raise ValueError(f"{where}: moe_intermediate = {m['moe_intermediate']} gives routed experts of "
                         f"{shape.routed:.4g} parameters, not fewer than parameters = {m['parameters']:.4g}")
    stated = m.get("active_parameters")
    if stated and abs(shape.active - stated) > ACTIVE_TOLERANCE * stated:
        raise ValueError(f"{where}: active_parameters = {stated:.4g} but the shapes give {shape.active:.4g} "
                         f"(parameters - routed experts + k experts a layer); fix the shapes or the figure")


def _check_mla(where: str, m: dict) -> None:
    """ValueError naming the MLA field of [model.NAME] that is missing or invalid."""
    given = [k for k in MLA_FIELDS if k in m]
    if not given:
        if "q_lora_rank" in m:
            raise ValueError(f"{where}: q_lora_rank without the latent: state all of {', '.join(MLA_FIELDS)}")
        return
    if len(given) < len(MLA_FIELDS):
        missing = [k for k in MLA_FIELDS if k not in m]
        raise ValueError(f"{where}: missing field {missing[0]!r}; an MLA model states all of {', '.join(MLA_FIELDS)}")
    for key in ("kv_heads", "head_dim"):
        if key in m:
            raise ValueError(f"{where}: {key} on an MLA model (kv_lora_rank): its KV is one latent shared by "
                             f"every head; drop {key} (the latent's width and the head dims price it)")
    for key in given + [k for k in MLA_OPTIONAL if k in m]:
        v = m[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {key} = {v!r} must be a whole number >= 1")


def _moe_shape(m: dict) -> MoeShape | None:
    """The routed experts of model ``m`` (checked by _check_model); None: a dense model."""
    if "num_experts" not in m:
        return None
    layers = m["layers"] - m.get("dense_layers", 0)
    one = 3 * m["hidden"] * m["moe_intermediate"]
    routed = layers * m["num_experts"] * one
    return MoeShape(m["num_experts"], m["experts_per_token"], layers, one, routed,
                    m["parameters"] - routed + layers * m["experts_per_token"] * one)


def _check_ep(where: str, ep, gpus: int, shape: MoeShape | None) -> None:
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"{where}: ep = {ep!r} must be a whole number >= 1")
    if ep > 1 and shape is None:
        raise ValueError(f"{where}: ep = {ep} on a dense model (no num_experts); expert parallelism "
                         f"needs a MoE model")
    if ep > 1 and (gpus < ep or gpus % ep):
        raise ValueError(f"{where}: ep = {ep} must divide the node's gpus = {gpus} (the engine's "
                         f"--enable-expert-parallel makes it gpus)")
    if shape is not None and shape.experts % ep:
        raise ValueError(f"{where}: ep = {ep} does not divide num_experts = {shape.experts}")


def _check_dp(where: str, dp, gpus: int, ep: int, shape: MoeShape | None) -> None:
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"{where}: dp = {dp!r} must be a whole number >= 1")
    if dp == 1:
        return
    if shape is None:
        raise ValueError(f"{where}: dp = {dp} on a dense model (no num_experts); data-parallel ranks share a "
                         f"MoE's experts (a dense model's ranks would be separate nodes: gpus = 1 profiles)")
    if gpus != dp:
        raise ValueError(f"{where}: dp = {dp} must equal gpus = {gpus} (one GPU per data-parallel rank, as "
                         f"the engine's --data-parallel-size)")
    if ep != dp:
        raise ValueError(f"{where}: dp = {dp} needs ep = {dp} (each rank holds E/dp experts whole), got ep = {ep}")


def _collective_link(where: str, ranks: int, what: str, purpose: str, hw: dict, data: dict) -> dict:
    """The [network.NAME] between ``ranks`` GPUs of one node: the hardware's interconnect
    within a host (gpus_per_host, default 8), its scale_out network across hosts."""
    per_host = hw.get("gpus_per_host", 8)
    field = "interconnect" if ranks <= per_host else "scale_out"
    name = hw.get(field, "")
    if name not in data.get("network", {}):
        span = f" ({ranks} ranks span hosts of {per_host} GPUs)" if field == "scale_out" else ""
        raise ValueError(f"{where}: {what} needs its hardware's {field} = a [network.NAME] of the file for "
                         f"the {purpose}{span}, got {name!r}")
    return data["network"][name]


def _moe_cost(where: str, shape: MoeShape, ep: int, dp: int, hidden: int, dtype: int, wbytes: float,
              hw: dict, data: dict) -> MoeCost:
    link = {"bytes_per_s": 0.0, "latency_s": 0.0}
    if dp > 1:
        link = _collective_link(where, dp, f"dp = {dp}", "gather + reduce", hw, data)
    elif ep > 1:
        link = _collective_link(where, ep, f"ep = {ep}", "all-to-all", hw, data)
    return MoeCost(experts=shape.experts, top_k=shape.top_k, moe_layers=shape.moe_layers,
                   expert_bytes=shape.moe_layers * shape.expert_params * wbytes, ep=ep, hidden=hidden,
                   dtype_bytes=dtype, link_bytes_per_s=link["bytes_per_s"], link_latency_s=link["latency_s"],
                   dp=dp)
