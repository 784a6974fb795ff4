"""Hardware profiles for the performance model: rates, link bandwidths and latencies, with sources.

Every number is a *lead* until a calibration file measured on our own machines overrides it
(``calibration/<name>.json`` next to this file is loaded by default; ``load_calibration`` reads
any other).  Each profile carries ``sources``: field name -> where the number came from.

Units: TFLOP/s (dense, no sparsity), GB/s (1e9 bytes/s) per GPU and per direction, microseconds.

NCCL collectives may also carry a *measured* table per world size (``nccl_measured``, fitted by
``benchmarks/calibrate_nccl.py`` from ``tpfuse bench`` rows): at a W in the table the collective
costs use it, at any other W the lead ``link_nccl_gbps`` / ``alpha_nccl_us``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "HardwareProfile",
    "NcclFit",
    "PROFILES",
    "get_profile",
    "detect",
    "load_calibration",
    "apply_calibration",
    "packaged_calibration_path",
    "profile_names",
]

_CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"


@dataclass(frozen=True)
class NcclFit:
    """NCCL collectives measured at one world size: ``time = alpha + bytes_per_rank / bus``.

    ``bytes_per_rank`` is what each rank sends (nccl-tests' bus-bandwidth convention):
    ``(W-1)/W * total`` for all-gather / reduce-scatter, twice that for all-reduce.  ``alpha_us``
    is the whole collective's fixed cost as measured (one call from the host, launch included),
    not a per-ring-step latency.
    """

    world_size: int
    bus_gbps: float
    alpha_us: float


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator (or the CPU test box) as the cost model sees it.

    GEMM efficiency curve (see ``cost.gemm_time``): a chunk runs at
    ``peak * gemm_eff_max * k / (k + gemm_k_half) * tile_util`` where ``tile_util`` is the best
    wave utilisation over the tile shapes a library picks from (smaller tiles pay
    ``gemm_tile_rel``) and by ``1 - gemm_throttle * t0 / (t0 + gemm_throttle_ms)`` for long
    kernels (power-limited clocks), blended with the HBM roofline ``bytes / (hbm * hbm_eff)`` by
    a p-norm of order ``gemm_blend_p``, plus ``gemm_launch_us``; the HBM bound has a fixed ramp
    ``hbm_latency_us`` (a memory-bound GEMM fills and drains its stream of loads), and a stream-K
    variant of each tile (no wave quantization) runs at ``gemm_streamk_rel`` of its rate.  Those
    eleven numbers are what ``benchmarks/calibrate_gemm.py`` fits.
    """

    name: str
    description: str
    # dense matrix rates, TFLOP/s (no 2:4 sparsity); fp32 is plain fp32 (TF32 off, torch default)
    tflops_bf16: float
    tflops_fp16: float
    tflops_fp8: float
    tflops_fp32: float
    tflops_fp64: float
    hbm_gbps: float
    sm_count: int
    # link (NVLink / PCIe / loopback), GB/s per GPU per direction
    link_name: str
    link_line_gbps: float
    link_nccl_gbps: float  # achieved bus bandwidth of NCCL ring collectives (large messages)
    link_ce_gbps: float  # achieved copy-engine peer-to-peer copy (cudaMemcpyPeerAsync / copy_)
    link_sm_gbps_per_sm: float  # SM-driven peer stores: rate one SM sustains
    link_sm_max_gbps: float  # SM-driven peer stores: ceiling, however many SMs push
    # latencies (alpha), microseconds
    alpha_nccl_us: float  # per step of a ring inside one NCCL collective
    alpha_p2p_us: float  # per torch.distributed P2P step (batch_isend_irecv from Python)
    alpha_ce_us: float  # per copy-engine copy, incl. signal wait/write
    alpha_sm_us: float  # per SM-driven chunk (flag release/acquire across GPUs)
    nccl_sms: int  # SMs an NCCL collective occupies while it runs next to a GEMM
    max_domain: int  # GPUs in one NVLink (or PCIe) domain
    # GEMM efficiency curve (fitted by benchmarks/calibrate_gemm.py; defaults are leads)
    gemm_eff_max: float = 0.80
    gemm_k_half: float = 128.0
    gemm_tile_rel: tuple[float, float, float] = (1.0, 0.85, 0.65)
    hbm_eff: float = 0.80
    gemm_blend_p: float = 3.0
    gemm_launch_us: float = 6.0
    gemm_throttle: float = 0.0  # rate lost to power-limited clocks by a long GEMM (fraction)
    gemm_throttle_ms: float = 1.0  # GEMM length (ms at burst rate) at which half of it is lost
    hbm_latency_us: float = 0.0  # fixed ramp of the HBM stream (fill and drain) beyond the launch
    gemm_streamk_rel: float = 0.0  # efficiency of a stream-K kernel (no wave quantization); 0 = none
    # host time a ring step costs beyond unfused (Python issue of the P2P exchange, events, the
    # per-step GEMM and casts); a step's GEMM cannot start before the host has issued it
    ring_step_host_us: float = 60.0
    # Eager host cost every strategy pays alike (0 under CUDA graphs): tpfuse's per-op dispatch
    # (the 25 us budget of issue 22.2, a lead until `tpfuse bench` measures host_us) and one
    # eager launch or collective call issued from Python (torch.matmul took 12-16 us of host time
    # per call on one H200, 2026-12-01, 2000 calls).
    host_op_us: float = 25.0
    host_call_us: float = 12.0
    # tpfuse's persistent Triton GEMM core (``tpfuse.gemm.matmul``: the fused strategy's one GEMM
    # launch per op) against cuBLAS on the same shape, kernel time (CUDA-graph replays):
    #   core = cuBLAS model / core_gemm_rel * (1 + core_<hook>_rel) + core_<hook>_us
    # with the wait hook (fused ag_gemm: "round" tile order, per-chunk waits) or the epilogue hook
    # (fused gemm_rs/gemm_ar: "owner" order, tiles stored to per-chunk destinations).
    # ``host_core_call_us``: host time of one such launch (torch.matmul's is host_call_us).  The
    # defaults are the H200 measurements (calibration/h200.json names the files and fields); on
    # other GPUs they are leads.
    core_gemm_rel: float = 0.983
    core_wait_rel: float = 0.0
    core_wait_us: float = 2.4
    core_epilogue_rel: float = 0.004
    core_epilogue_us: float = 10.8
    host_core_call_us: float = 42.0
    # A group larger than the NVLink domain spans hosts: NCCL over the network (lead: one
    # 400 Gb/s NDR InfiniBand NIC per GPU, ~90 % achieved by NCCL).
    link_internode_gbps: float = 45.0
    # measured NCCL collectives per world size (benchmarks/calibrate_nccl.py); () = leads only
    nccl_measured: tuple[NcclFit, ...] = ()
    calibrated: str = ""  # "" = datasheet/lead numbers only; else what calibration was applied
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def tflops(self, dtype_name: str) -> float:
        """Dense TFLOP/s for a canonical dtype name (``bf16``, ``fp16``, ``fp8``, ``fp32``, ``fp64``)."""
        try:
            return getattr(self, f"tflops_{dtype_name}")
        except AttributeError:
            raise ValueError(
                f"dtype: {dtype_name!r} has no rate in profile {self.name!r}; "
                "use one of bf16, fp16, fp8, fp32, fp64"
            ) from None

    def sm_p2p_gbps(self, num_sms: int) -> float:
        """Achieved SM-driven peer bandwidth when ``num_sms`` SMs move the bytes."""
        if num_sms <= 0:
            return 0.0
        return min(self.link_sm_max_gbps, num_sms * self.link_sm_gbps_per_sm)

    def nccl_fit(self, world_size: int) -> NcclFit | None:
        """The measured NCCL table entry for ``world_size``, or None (then the leads apply)."""
        for fit in self.nccl_measured:
            if fit.world_size == world_size:
                return fit
        return None

    def source(self, field_name: str) -> str:
        """Where a field's number came from ("" if the profile does not say)."""
        return dict(self.sources).get(field_name, "")


# --- sources, quoted once and reused -------------------------------------------------------------
_H100_DS = "NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense = half the 2:4-sparse figure)"
_H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (SXM: H100 compute, 141 GB HBM3e at 4.8 TB/s)"
_B200_DS = "NVIDIA DGX/HGX B200 datasheet, per GPU (dense = half the sparse figure)"
_GB200_DS = "NVIDIA GB200 NVL72 datasheet, rack figures / 72 (dense = half the sparse figure)"
_NVL4 = "NVLink4: 18 links x 25 GB/s/dir = 450 GB/s/dir (900 GB/s bidirectional) per GPU"
_NVL5 = "NVLink5: 18 links x 50 GB/s/dir = 900 GB/s/dir (1.8 TB/s bidirectional) per GPU"
_NCCL_H100 = ("nccl-tests all_gather busbw on 8xH100 SXM ~360-380 GB/s (NVIDIA/NCCL reports); "
              "DESIGN §5 uses ~370")
_CE_H100 = ("copy-engine P2P ~380 GB/s/dir on H100 NVLink4 (DESIGN §5; CUTLASS ex. 65 DistGEMM "
            "and PyTorch async-TP report CE copies near NCCL busbw)")
_SM_P2P = ("SM-driven P2P: lead estimate, ~25 GB/s per SM of ld/st over NVLink, saturating near "
           "the CE rate with ~16-20 SMs (Triton-distributed / FLUX use 8-20 comm SMs); calibrate")
_ALPHA = ("alpha: lead estimates: nccl-tests all_gather on 8xH100 takes ~20 us at 1 MB, i.e. ~3 us "
          "per ring step; a Python-issued batch_isend_irecv step ~10-15 us; ~3-5 us for a CE copy "
          "+ stream wait; ~2 us for a cross-GPU flag release/acquire; calibrate")
_GEMM_LEAD = "GEMM curve defaults: lead; overridden by calibration/<name>.json where present"


def _src(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kw.items()))


PROFILES: dict[str, HardwareProfile] = {}


def _register(p: HardwareProfile) -> HardwareProfile:
    PROFILES[p.name] = p
    return p


_register(HardwareProfile(
    name="h100", description="NVIDIA H100 SXM5 80GB, NVLink4 via NVSwitch (HGX 8-GPU)",
    tflops_bf16=989.4, tflops_fp16=989.4, tflops_fp8=1978.9, tflops_fp32=66.9, tflops_fp64=66.9,
    hbm_gbps=3350.0, sm_count=132,
    link_name="NVLink4", link_line_gbps=450.0, link_nccl_gbps=370.0, link_ce_gbps=380.0,
    link_sm_gbps_per_sm=25.0, link_sm_max_gbps=380.0,
    alpha_nccl_us=3.0, alpha_p2p_us=12.0, alpha_ce_us=4.0, alpha_sm_us=2.0, nccl_sms=16, max_domain=8,
    sources=_src(tflops_bf16=_H100_DS, hbm_gbps=_H100_DS, sm_count=_H100_DS, link_line_gbps=_NVL4,
                 link_nccl_gbps=_NCCL_H100, link_ce_gbps=_CE_H100, link_sm_gbps_per_sm=_SM_P2P,
                 alpha_nccl_us=_ALPHA, nccl_sms="NCCL default ring channels on NVSwitch: ~16 CTAs",
                 max_domain="HGX H100: 8 GPUs per NVSwitch domain", gemm_eff_max=_GEMM_LEAD),
))
_register(dataclasses.replace(
    PROFILES["h100"], name="h200", description="NVIDIA H200 SXM 141GB, NVLink4 via NVSwitch (HGX 8-GPU)",
    hbm_gbps=4800.0,
    sources=_src(tflops_bf16=_H200_DS, hbm_gbps=_H200_DS, sm_count=_H200_DS, link_line_gbps=_NVL4,
                 link_nccl_gbps=_NCCL_H100, link_ce_gbps=_CE_H100, link_sm_gbps_per_sm=_SM_P2P,
                 alpha_nccl_us=_ALPHA, nccl_sms="NCCL default ring channels on NVSwitch: ~16 CTAs",
                 max_domain="HGX H200: 8 GPUs per NVSwitch domain",
                 gemm_eff_max=_GEMM_LEAD + "; measured here: cuBLAS 8192^3 bf16 730-798 TFLOP/s "
                 "(DESIGN §8, KINDS.md)"),
))
_register(HardwareProfile(
    name="b200", description="NVIDIA B200 (HGX B200 8-GPU), NVLink5 via NVSwitch",
    tflops_bf16=2250.0, tflops_fp16=2250.0, tflops_fp8=4500.0, tflops_fp32=75.0, tflops_fp64=37.0,
    hbm_gbps=8000.0, sm_count=148,
    link_name="NVLink5", link_line_gbps=900.0, link_nccl_gbps=720.0, link_ce_gbps=740.0,
    link_sm_gbps_per_sm=40.0, link_sm_max_gbps=740.0,
    alpha_nccl_us=3.0, alpha_p2p_us=12.0, alpha_ce_us=4.0, alpha_sm_us=2.0, nccl_sms=16, max_domain=8,
    sources=_src(tflops_bf16=_B200_DS, hbm_gbps=_B200_DS, sm_count="B200: 148 SMs (Blackwell whitepaper)",
                 link_line_gbps=_NVL5,
                 link_nccl_gbps="lead: ~80% of NVLink5 line rate, by analogy with H100 (370/450)",
                 link_ce_gbps="lead: ~82% of line rate, by analogy with H100", alpha_nccl_us=_ALPHA,
                 link_sm_gbps_per_sm=_SM_P2P, max_domain="HGX B200: 8 GPUs", gemm_eff_max=_GEMM_LEAD),
))
_register(dataclasses.replace(
    PROFILES["b200"], name="gb200",
    description="NVIDIA GB200 NVL72: 72 Blackwell GPUs in one NVLink5 domain",
    tflops_bf16=2500.0, tflops_fp16=2500.0, tflops_fp8=5000.0, tflops_fp32=80.0, tflops_fp64=40.0,
    max_domain=72,
    sources=_src(tflops_bf16=_GB200_DS, hbm_gbps=_GB200_DS, sm_count="Blackwell B200 die pair: 148 SMs",
                 link_line_gbps=_NVL5,
                 link_nccl_gbps="lead: ~80% of NVLink5 line rate, by analogy with H100 (370/450)",
                 link_ce_gbps="lead: ~82% of line rate, by analogy with H100", alpha_nccl_us=_ALPHA,
                 link_sm_gbps_per_sm=_SM_P2P,
                 max_domain="GB200 NVL72: 72 GPUs, 9 NVLink switch trays, one NVLink domain",
                 gemm_eff_max=_GEMM_LEAD),
))
_register(HardwareProfile(
    name="h100-pcie", description="NVIDIA H100 PCIe 80GB, no NVLink bridge: peers over PCIe Gen5 x16",
    tflops_bf16=756.0, tflops_fp16=756.0, tflops_fp8=1513.0, tflops_fp32=51.0, tflops_fp64=51.0,
    hbm_gbps=2000.0, sm_count=114,
    link_name="PCIe5 x16", link_line_gbps=64.0, link_nccl_gbps=40.0, link_ce_gbps=50.0,
    link_sm_gbps_per_sm=6.0, link_sm_max_gbps=45.0,
    alpha_nccl_us=8.0, alpha_p2p_us=20.0, alpha_ce_us=8.0, alpha_sm_us=5.0, nccl_sms=8, max_domain=8,
    sources=_src(tflops_bf16="NVIDIA H100 PCIe datasheet (dense = half the sparse figure)",
                 hbm_gbps="NVIDIA H100 PCIe datasheet: 2.0 TB/s HBM2e", sm_count="H100 PCIe: 114 SMs",
                 link_line_gbps="PCIe Gen5 x16: 64 GB/s per direction (raw, before protocol overhead)",
                 link_nccl_gbps="lead: NCCL over PCIe through the host bridge/switch, ~60% of line",
                 link_ce_gbps="lead: CE P2P over a PCIe switch ~50 GB/s", alpha_nccl_us=_ALPHA,
                 link_sm_gbps_per_sm="lead: SM stores over PCIe saturate with few SMs",
                 max_domain="typical 8-GPU PCIe server", gemm_eff_max=_GEMM_LEAD),
))
_register(HardwareProfile(
    name="l40s", description="NVIDIA L40S 48GB (Ada, PCIe Gen4 x16, no NVLink)",
    tflops_bf16=362.0, tflops_fp16=362.0, tflops_fp8=733.0, tflops_fp32=91.6, tflops_fp64=1.4,
    hbm_gbps=864.0, sm_count=142,
    link_name="PCIe4 x16", link_line_gbps=32.0, link_nccl_gbps=20.0, link_ce_gbps=25.0,
    link_sm_gbps_per_sm=3.0, link_sm_max_gbps=22.0,
    alpha_nccl_us=8.0, alpha_p2p_us=20.0, alpha_ce_us=8.0, alpha_sm_us=5.0, nccl_sms=8, max_domain=8,
    sources=_src(tflops_bf16="NVIDIA L40S datasheet: 362 TFLOP/s bf16 dense (733 sparse)",
                 hbm_gbps="NVIDIA L40S datasheet: 864 GB/s GDDR6", sm_count="L40S: 142 SMs",
                 link_line_gbps="PCIe Gen4 x16: 32 GB/s per direction",
                 link_nccl_gbps="lead: NCCL over PCIe Gen4 ~20 GB/s busbw",
                 link_ce_gbps="lead", alpha_nccl_us=_ALPHA, max_domain="typical 8-GPU PCIe server",
                 gemm_eff_max=_GEMM_LEAD),
))
_register(HardwareProfile(
    name="cpu-gloo",
    description="ROUGH: the CPU test box, W processes on one host talking gloo over loopback TCP",
    tflops_bf16=0.05, tflops_fp16=0.02, tflops_fp8=0.02, tflops_fp32=0.3, tflops_fp64=0.15,
    hbm_gbps=20.0, sm_count=8,
    link_name="gloo/TCP loopback", link_line_gbps=5.0, link_nccl_gbps=2.0, link_ce_gbps=2.0,
    link_sm_gbps_per_sm=1.0, link_sm_max_gbps=2.0,
    alpha_nccl_us=80.0, alpha_p2p_us=150.0, alpha_ce_us=80.0, alpha_sm_us=80.0, nccl_sms=1, max_domain=64,
    gemm_eff_max=0.7, gemm_k_half=32.0, gemm_tile_rel=(1.0, 1.0, 1.0), hbm_eff=0.5,
    gemm_launch_us=20.0,
    sources=_src(**{f: "ROUGH guess for a few-core CI VM (torch CPU matmul, gloo over TCP "
                       "loopback); orders of magnitude only, never used for GPU decisions"
                    for f in ("tflops_bf16", "tflops_fp32", "hbm_gbps", "link_line_gbps", "link_nccl_gbps",
                              "alpha_nccl_us", "sm_count")}),
))

_ALIASES = {"h100-sxm": "h100", "h200-sxm": "h200", "gb200-nvl72": "gb200", "cpu": "cpu-gloo",
            "gloo": "cpu-gloo", "h100pcie": "h100-pcie"}


def profile_names() -> tuple[str, ...]:
    return tuple(PROFILES)


def packaged_calibration_path(name: str) -> Path:
    """Where the calibration shipped with tpfuse for profile ``name`` lives (may not exist)."""
    return _CALIBRATION_DIR / f"{name}.json"


def load_calibration(path: str | os.PathLike) -> dict[str, Any]:
    """Read a calibration JSON: ``{"profile": name, "overrides": {field: value}, ...}``.

    Optional: ``"sources": {field: text}`` says where an override came from (else the file's
    ``meta`` gpu and date); ``overrides["nccl_measured"]`` is
    ``{"<world_size>": {"bus_gbps": ..., "alpha_us": ...}}``.

    Raises ``ValueError`` naming the file when it is not such a file.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"calibration: cannot read {str(path)!r} ({exc}); pass a JSON file written "
                         "by benchmarks/calibrate_gemm.py") from None
    if not isinstance(data, dict) or not isinstance(data.get("overrides"), dict):
        raise ValueError(f"calibration: {str(path)!r} has no 'overrides' object; pass a JSON file "
                         "written by benchmarks/calibrate_gemm.py")
    return data


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(HardwareProfile)}
_NOT_OVERRIDABLE = {"name", "sources", "calibrated"}


def apply_calibration(profile: HardwareProfile, calibration: Mapping[str, Any] | str | os.PathLike,
                      ) -> HardwareProfile:
    """``profile`` with the calibration's overrides applied (a new frozen profile)."""
    label = "dict"
    if not isinstance(calibration, Mapping):
        label = str(calibration)
        calibration = load_calibration(calibration)
    overrides = dict(calibration["overrides"])
    for key in overrides:
        if key not in _FIELD_TYPES or key in _NOT_OVERRIDABLE:
            raise ValueError(f"calibration: unknown or fixed field {key!r}; overridable fields are "
                             f"{sorted(set(_FIELD_TYPES) - _NOT_OVERRIDABLE)}")
    if "gemm_tile_rel" in overrides:
        overrides["gemm_tile_rel"] = tuple(float(x) for x in overrides["gemm_tile_rel"])
    if "nccl_measured" in overrides:
        overrides["nccl_measured"] = _nccl_table(overrides["nccl_measured"], label)
    meta = calibration.get("meta", {})
    what = f"{label} ({meta.get('gpu', '?')}, {meta.get('date', '?')})"
    sources = dict(profile.sources)
    own = calibration.get("sources", {})
    for key in overrides:
        sources[key] = f"calibrated: {own[key]}" if key in own else f"calibrated: {what}"
    return dataclasses.replace(profile, **overrides, calibrated=what, sources=tuple(sorted(sources.items())))


def _nccl_table(raw: Any, label: str) -> tuple[NcclFit, ...]:
    """``{"2": {"bus_gbps": 234.0, "alpha_us": 121.0}, ...}`` -> NcclFit entries sorted by W."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"calibration: {label}: nccl_measured must map world_size -> "
                         f"{{'bus_gbps', 'alpha_us'}}, got {type(raw).__name__}")
    table = []
    for w, entry in raw.items():
        try:
            fit = NcclFit(int(w), float(entry["bus_gbps"]), float(entry["alpha_us"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"calibration: {label}: nccl_measured[{w!r}] = {entry!r}; give an int "
                             "world size mapping to {'bus_gbps': float, 'alpha_us': float}") from None
        if fit.world_size < 2 or fit.bus_gbps <= 0 or fit.alpha_us < 0:
            raise ValueError(f"calibration: {label}: nccl_measured[{w!r}] = {entry!r} is not physical "
                             "(need world_size >= 2, bus_gbps > 0, alpha_us >= 0)")
        table.append(fit)
    return tuple(sorted(table, key=lambda f: f.world_size))


@functools.lru_cache(maxsize=None)
def _calibrated(name: str, path: str | None) -> HardwareProfile:
    base = PROFILES[name]
    if path is None:
        packaged = packaged_calibration_path(name)
        if not packaged.exists():
            return base
        path = str(packaged)
    return apply_calibration(base, path)


def get_profile(name: str | HardwareProfile, calibration: bool | str | os.PathLike = True,
                ) -> HardwareProfile:
    """The profile called ``name``.

    ``calibration=True`` applies the calibration packaged with tpfuse when there is one,
    ``False`` gives the datasheet/lead numbers, a path applies that calibration file.
    A ``HardwareProfile`` passes through unchanged.
    """
    if isinstance(name, HardwareProfile):
        return name
    if not isinstance(name, str):
        raise TypeError(f"hardware: expected a profile name or HardwareProfile, got {type(name).__name__}")
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in PROFILES:
        raise ValueError(f"hardware: unknown profile {name!r}; choose from {sorted(PROFILES)}")
    if calibration is False:
        return PROFILES[key]
    if calibration is True:
        return _calibrated(key, None)
    return _calibrated(key, str(os.fspath(calibration)))


# torch.cuda.get_device_name substrings -> profile; first match wins (longest, most specific first)
_DEVICE_NAME_MAP: tuple[tuple[str, str], ...] = (
    ("GB200", "gb200"),
    ("B200", "b200"),
    ("H200", "h200"),
    ("H100 PCIE", "h100-pcie"),
    ("H100", "h100"),
    ("H800", "h100"),
    ("L40S", "l40s"),
)


def profile_for_device_name(device_name: str) -> str | None:
    """Profile name for a CUDA device name, or None when we have no profile for it."""
    upper = device_name.upper()
    for needle, name in _DEVICE_NAME_MAP:
        if needle in upper:
            return name
    return None


def _profile_for_gpu(device_name: str) -> HardwareProfile:
    name = profile_for_device_name(device_name)
    if name is None:
        warnings.warn(f"tpfuse: no hardware profile for GPU {device_name!r}; using 'h100' numbers, "
                      "predictions will be rough (add a profile or a calibration file)", stacklevel=4)
        name = "h100"
    return get_profile(name)


@functools.lru_cache(maxsize=None)
def _detect_index(index: int) -> HardwareProfile:
    import torch

    return _profile_for_gpu(torch.cuda.get_device_name(index))


@functools.lru_cache(maxsize=None)
def _detect_name(device_name: str) -> HardwareProfile:
    return _profile_for_gpu(device_name)


def detect(device: Any = None) -> HardwareProfile:
    """Profile of a GPU: ``device`` is None (the current CUDA device), a ``torch.device``, an
    index, ``"cuda"`` / ``"cuda:1"``, or a GPU name as ``torch.cuda.get_device_name`` reports it
    (``"NVIDIA H200"``; needs no CUDA).  A CPU device, or no CUDA at all, gives ``cpu-gloo``.
    Cached per GPU: a repeat costs about a microsecond (what ``fused`` pays at dispatch)."""
    import torch

    if isinstance(device, str) and not device.lower().startswith(("cuda", "cpu")):
        return _detect_name(device)
    if device is not None and not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"detect: expected None, a torch.device, an index or a device name, got "
                        f"{type(device).__name__} {device!r}")
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return get_profile("cpu-gloo")
    return _detect_index(torch.cuda.current_device() if dev.index is None else dev.index)
