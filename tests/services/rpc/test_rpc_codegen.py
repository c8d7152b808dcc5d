"""The committed stub package is exactly what `kvrelay codegen` produces from proto/."""

from __future__ import annotations

import shutil
from pathlib import Path

from services.rpc import codegen


def test_regenerating_the_stubs_changes_nothing() -> None:
    assert codegen.diff_against() == []


def test_a_schema_change_is_detected(tmp_path: Path) -> None:
    proto_root = tmp_path / "proto"
    shutil.copytree(codegen.PROTO_ROOT, proto_root)
    policy = proto_root / "kvrelay" / "v1" / "policy.proto"
    policy.write_text(policy.read_text().replace("  bool already_published = 2;\n",
                                                 "  bool already_published = 2;\n  bool extra = 3;\n"))
    assert codegen.diff_against(proto_root=proto_root) == [
        "kvrelay/v1/policy_pb2.py", "kvrelay/v1/policy_pb2.pyi"
    ]


def test_generate_writes_importable_stubs_and_removes_stale_ones(tmp_path: Path) -> None:
    stale = tmp_path / "kvrelay" / "v1" / "retired_pb2.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    result = codegen.generate(tmp_path)
    assert result.removed == (Path("kvrelay/v1/retired_pb2.py"),)
    names = {p.name for p in result.written}
    for stem in ("common", "policy", "gateway", "prefill", "decode", "offload"):
        assert {f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"} <= names
    for path in (tmp_path / "kvrelay" / "v1").glob("*.py*"):
        text = path.read_text()
        assert "from kvrelay.v1" not in text and "import kvrelay" not in text, path


def test_rewrite_imports_targets_the_services_package() -> None:
    source = "from kvrelay.v1 import common_pb2 as _common_pb2\nfrom kvrelay.v1.x import y\nkvrelay.v1 stays\n"
    assert codegen.rewrite_imports(source) == (
        "from services.rpc.kvrelay.v1 import common_pb2 as _common_pb2\n"
        "from services.rpc.kvrelay.v1.x import y\nkvrelay.v1 stays\n"
    )


def test_every_service_of_the_schema_is_generated() -> None:
    from services.rpc.kvrelay.v1 import (
        common_pb2,
        decode_pb2,
        gateway_pb2,
        offload_pb2,
        policy_pb2,
        prefill_pb2,
    )

    services = {
        name
        for module in (gateway_pb2, policy_pb2, prefill_pb2, decode_pb2, offload_pb2)
        for name in module.DESCRIPTOR.services_by_name
    }
    assert services == {"Gateway", "PolicyService", "PrefillWorker", "DecodeWorker", "OffloadService"}
    policy_methods = {m.name for m in policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].methods}
    assert policy_methods == {
        "RegisterManifest", "GetManifest", "ListManifests", "BeginRequest", "PublishState", "GetFence", "EndRequest",
        "Session",
    }
    generate = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods_by_name["Generate"]
    assert generate.server_streaming and not generate.client_streaming
    descriptor = decode_pb2.TransferDescriptor.DESCRIPTOR.fields_by_name
    for field in ("transfer_id", "request_id", "receipt", "tensors", "rendezvous_address", "trace_context"):
        assert field in descriptor
    # Generations travel once, in the receipt.
    assert "request_generation" not in descriptor
    assert "request_generation" in common_pb2.Generations.DESCRIPTOR.fields_by_name
