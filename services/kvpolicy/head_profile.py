"""HeadKV importance profiles of a checkpoint: beside it, or shipped with kvrelay.

Where a checkpoint's profile lives (`profile_path`): inside an HF directory as
`headkv_profile.safetensors`; beside a `.gguf` file as `<file>.headkv_profile.safetensors`.
A checkpoint without one may still have a profile shipped in this package
(`services/kvpolicy/profiles/<checkpoint sha256>.headkv_profile.safetensors`, found by the
digest of the checkpoint, `checkpoint_sha256`): the bundled default model sits in
site-packages, where nothing should be written, so its calibrated profile ships here.

A profile holds a checkpoint's retrieval-head scores twice: per K/V head `[L, H_kv]` (the owners
of the GQA reductions `mean` and `max`; the profile's identity) and per query head `[L, H_q]`
(the owners under `expand`). A HeadKV manifest names the tensor it was built for by
`allocation.profile_sha256` (shape plus little-endian float32 values), so a worker finds the
right tensor by digest and a changed profile can never be used under an old manifest.

The safetensors header carries the provenance as JSON under `kvrelay.headkv_profile`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.kvpolicy.allocation import profile_sha256
from services.kvpolicy.errors import HeadProfileUnavailable
from services.kvpolicy.manifest import AllocationMethod, KVVisibilityPolicyManifest

PROFILE_FILE = "headkv_profile.safetensors"
PROFILE_SUFFIX = "." + PROFILE_FILE  # beside a checkpoint file: `<file>.headkv_profile...`
SHIPPED_PROFILES = Path(__file__).resolve().parent / "profiles"
KV_HEAD_KEY = "kv_head"  # [L, H_kv]
QUERY_HEAD_KEY = "query_head"  # [L, H_q]
METADATA_KEY = "kvrelay.headkv_profile"
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")




class ProfileFileInvalid(ValueError):
    """A profile file exists but cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ProfileProvenance:
    """How a profile was measured (written into the file header)."""

    method: str
    prompts: int
    seed: int
    context_lengths: tuple[int, ...]
    placements: tuple[str, ...]
    distractors: int
    checkpoint_sha256: str
    answer_accuracy: float  # share of calibration prompts the full-cache model answered


@dataclass(frozen=True)
class HeadProfile:
    """Retrieval-head scores of one checkpoint, per K/V head and per query head."""

    kv_head: torch.Tensor  # [L, H_kv] float32
    query_head: torch.Tensor  # [L, H_q] float32
    provenance: ProfileProvenance

    @property
    def sha256(self) -> str:
        """The profile's identity: the digest of the per-K/V-head tensor."""
        return profile_sha256(self.kv_head)

    @property
    def query_head_sha256(self) -> str:
        return profile_sha256(self.query_head)

    def tensor_for(self, digest: str) -> torch.Tensor | None:
        """The stored tensor whose `profile_sha256` is `digest`, or None."""
        for tensor in (self.kv_head, self.query_head):
            if profile_sha256(tensor) == digest:
                return tensor
        return None

    def check_shape(self, num_layers: int, num_q_heads: int, num_kv_heads: int) -> None:
        """ProfileFileInvalid unless the tensors are `[L, H_kv]` and `[L, H_q]` of this model."""
        checks = (
            (KV_HEAD_KEY, self.kv_head, (num_layers, num_kv_heads)),
            (QUERY_HEAD_KEY, self.query_head, (num_layers, num_q_heads)),
        )
        for key, tensor, expected in checks:
            shape = tuple(tensor.shape)
            if shape != expected:
                raise ProfileFileInvalid(
                    f"{PROFILE_FILE}:{key} has shape {shape}, the model needs {expected}"
                )


def profile_tensor(
    manifest: KVVisibilityPolicyManifest, profile: HeadProfile | None
) -> torch.Tensor | None:
    """The importance tensor `[L, H_owner]` a HeadKV manifest names by digest; None for other
    allocation methods. HeadProfileUnavailable when `profile` (the served checkpoint's, if it
    has one) holds no tensor of that digest."""
    spec = manifest.selection.allocation
    wanted = spec.headkv_profile_sha256 if spec is not None else None
    if spec is None or spec.method is not AllocationMethod.HEADKV or wanted is None:
        return None
    tensor = profile.tensor_for(wanted) if profile is not None else None
    if tensor is None:
        found = f"its profile is {profile.sha256}" if profile else f"it has no {PROFILE_FILE}"
        raise HeadProfileUnavailable(f"the served checkpoint has no profile {wanted} ({found})")
    return tensor


def profile_path(checkpoint: Path) -> Path:
    """Where the profile of `checkpoint` (an HF directory or a checkpoint file) is written."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        return checkpoint.with_name(checkpoint.name + PROFILE_SUFFIX)
    return checkpoint / PROFILE_FILE


def shipped_profile_path(checkpoint_digest: str) -> Path:
    """Where a profile shipped with kvrelay for the checkpoint of this digest would be."""
    return SHIPPED_PROFILES / f"{checkpoint_digest}{PROFILE_SUFFIX}"


def save_profile(checkpoint: Path, profile: HeadProfile, path: Path | None = None) -> Path:
    """Write the profile to `path` (default: `profile_path(checkpoint)`), replacing any older one."""
    path = Path(path) if path is not None else profile_path(checkpoint)
    tensors = {
        KV_HEAD_KEY: profile.kv_head.detach().to(torch.float32).contiguous(),
        QUERY_HEAD_KEY: profile.query_head.detach().to(torch.float32).contiguous(),
    }
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(asdict(profile.provenance))})
    return path


def load_profile(checkpoint: Path) -> HeadProfile | None:
    """The profile beside `checkpoint`; for a checkpoint file without one, the profile shipped
    for its digest (checked against the digest its provenance records); else None."""
    path = profile_path(checkpoint)
    if path.is_file():
        return read_profile(path)
    if not Path(checkpoint).is_file():
        return None
    digest = checkpoint_sha256(checkpoint)
    shipped = shipped_profile_path(digest)
    if not shipped.is_file():
        return None
    profile = read_profile(shipped)
    if profile.provenance.checkpoint_sha256 != digest:
        raise ProfileFileInvalid(
            f"{shipped}: provenance names checkpoint {profile.provenance.checkpoint_sha256}"
        )
    return profile


def read_profile(path: Path) -> HeadProfile:
    """The profile in one safetensors file; ProfileFileInvalid naming what is wrong."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            raw = (handle.metadata() or {}).get(METADATA_KEY)
            kv_head, query_head = handle.get_tensor(KV_HEAD_KEY), handle.get_tensor(QUERY_HEAD_KEY)
        provenance = _provenance(json.loads(raw) if raw is not None else None)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ProfileFileInvalid(f"{path}: {exc}") from exc
    for key, tensor in ((KV_HEAD_KEY, kv_head), (QUERY_HEAD_KEY, query_head)):
        if tensor.dtype != torch.float32 or tensor.dim() != 2:
            raise ProfileFileInvalid(f"{path}:{key} must be a 2-D float32 tensor")
        if not bool(torch.isfinite(tensor).all()) or bool((tensor < 0).any()):
            raise ProfileFileInvalid(f"{path}:{key} must be finite and non-negative")
    return HeadProfile(kv_head, query_head, provenance)


def checkpoint_sha256(directory: Path) -> str:
    """SHA-256 over the checkpoint's config and weight files (name, size, bytes), in name order;
    for a `.gguf` file, over its size and bytes (the file holds config and weights; a renamed
    copy keeps its digest)."""
    digest = hashlib.sha256()
    if Path(directory).suffix.lower() == ".gguf" and Path(directory).is_file():
        _hash_file(digest, Path(directory), label="gguf")
        return digest.hexdigest()
    for name in _CHECKPOINT_FILES:
        path = Path(directory) / name
        if path.is_file():
            _hash_file(digest, path)
    index = Path(directory) / "model.safetensors.index.json"
    if index.is_file():
        for shard in sorted(set(json.loads(index.read_text()).get("weight_map", {}).values())):
            _hash_file(digest, Path(directory) / shard)
    return digest.hexdigest()


def _hash_file(digest: hashlib._Hash, path: Path, label: str | None = None) -> None:
    digest.update(f"{label or path.name}:{path.stat().st_size}:".encode())
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)


def _provenance(data: object) -> ProfileProvenance:
    if not isinstance(data, dict):
        raise ValueError(f"header key {METADATA_KEY} is missing or not a JSON object")
    data = {**data, "context_lengths": tuple(data["context_lengths"]),
            "placements": tuple(data["placements"])}
    return ProfileProvenance(**data)
