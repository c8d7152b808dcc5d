"""HeadKV profiles shipped with kvrelay, one file per checkpoint digest.

`<checkpoint sha256>.headkv_profile.safetensors` (see `services.evaluation.profile`): the
bundled default model lives in site-packages, where no profile should be written beside it,
so `kvrelay calibrate <gguf> --out services/evaluation/profiles/<digest>...` stores it here.
"""
