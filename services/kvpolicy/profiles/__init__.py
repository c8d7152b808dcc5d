"""HeadKV profiles shipped with kvrelay, one file per checkpoint digest.

`<checkpoint sha256>.headkv_profile.safetensors` (see `services.kvpolicy.head_profile`): the
bundled default model lives in site-packages, where no profile should be written beside it,
so `kvrelay calibrate <gguf> --out services/kvpolicy/profiles/<digest>...` stores it here.
"""
