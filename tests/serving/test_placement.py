"""Data parallel x tensor parallel placement of the engine model (backend/serving/engine_model/placement.py).

No GPU exists here: the rendered KIND_GPU repository is checked with Triton's own protobuf schema
(tritonclient's model_config_pb2), not loaded (Triton refuses a KIND_GPU group on a host without a
GPU: "specifies invalid or unsupported gpu id 0"), and every GPU count below is INJECTED, standing
in for a GPU host's torch.cuda.device_count().
"""
from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from backend import bundle
from backend.bundle_schema import ModelConfig
from backend.serving.engine_model.model_args import instance_count, instance_placement
from backend.serving.engine_model.placement import (PlacementError, check_visible, instance_gpus, parse_gpus,
                                       place_instance)
from builder.config import BuildConfig
from builder.stages.package import render_repository, template_values


def _render(tmp_path, tp_size: int, **serving) -> model_config_pb2.ModelConfig:
    cfg = BuildConfig.from_dict({"serving": serving})
    render_repository(template_values(cfg.serving, "../engine", tp_size=tp_size), tmp_path)
    return text_format.Parse((tmp_path / "tensorrt_llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def _params(pb) -> dict[str, str]:
    return {k: v.string_value for k, v in pb.parameters.items()}


def test_instance_i_owns_gpus_i_tp_to_i_plus_one_tp():
    assert instance_gpus(2, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert instance_gpus(1, 3) == [[0], [1], [2]]
    assert parse_gpus("0,1;2,3") == [[0, 1], [2, 3]] and parse_gpus("") == []
    with pytest.raises(PlacementError, match="allowed: GPU ids"):
        parse_gpus("0,a")


def test_cuda_renders_one_kind_gpu_group_per_instance_listing_its_first_gpu(tmp_path):
    pb = _render(tmp_path, 2, device="cuda", engine_instances=4)
    groups = [(g.kind, g.count, list(g.gpus)) for g in pb.instance_group]
    # Triton starts `count` instances on EACH GPU a group lists: listing [0, 1] would start two
    assert groups == [(model_config_pb2.ModelInstanceGroup.KIND_GPU, 1, [g]) for g in (0, 2, 4, 6)]
    assert _params(pb)["instance_gpus"] == "0,1;2,3;4,5;6,7" and _params(pb)["device"] == "cuda"
    assert instance_count({"instance_group": [{"kind": "KIND_GPU", "count": g.count, "gpus": list(g.gpus)}
                                              for g in pb.instance_group]}) == 4


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cpu_and_auto_keep_kind_cpu_count_n(tmp_path, device):
    pb = _render(tmp_path, 2, device=device, engine_instances=3)
    assert [(g.kind, g.count, list(g.gpus)) for g in pb.instance_group] == [
        (model_config_pb2.ModelInstanceGroup.KIND_CPU, 3, [])]
    assert _params(pb)["instance_gpus"] == "" and _params(pb)["device"] == device


def test_default_config_renders_auto_kind_cpu(tmp_path):
    assert BuildConfig.from_dict({}).serving.device == "auto"
    assert [g.count for g in _render(tmp_path, 1).instance_group] == [1]


def test_refusal_names_both_numbers_and_the_fix():
    # stands in for a GPU host with 4 visible GPUs: the count is injected
    check_visible(2, 2, visible=4)
    with pytest.raises(PlacementError) as e:
        check_visible(2, 4, visible=4)
    msg = str(e.value)
    assert "engine.tp_size 2 x serving.engine_instances 4 needs 8 GPUs, but 4 are visible" in msg
    assert "rebuild with fewer" in msg and "tp x instances <= 4" in msg


def _args(kind: str, device_id: int, device: str, gpus: str, instances: int = 1) -> tuple[dict, dict]:
    group = ({"kind": "KIND_GPU", "count": 1, "gpus": [device_id]} if kind == "GPU"
             else {"kind": "KIND_CPU", "count": instances})
    cfg = {"name": "tensorrt_llm", "instance_group": [group],
           "parameters": {"device": {"string_value": device}, "instance_gpus": {"string_value": gpus}}}
    return {"model_instance_kind": kind, "model_instance_device_id": str(device_id)}, cfg


def test_gpu_instance_takes_its_first_gpu_and_its_tp_group():
    # stands in for an 8-GPU host (visible injected): instance 2 of tp 2 x 4 lands on GPUs 4, 5
    p = place_instance("GPU", 4, "cuda", "0,1;2,3;4,5;6,7", 2, visible=lambda: 8)
    assert (p.device, p.gpus) == ("cuda:4", (4, 5))


def test_gpu_instance_refuses_too_few_visible_gpus():
    # stands in for a 4-GPU host serving a repository rendered for tp 2 x 4 instances
    with pytest.raises(PlacementError, match="tp_size 2 x serving.engine_instances 4 needs 8 GPUs, but 4"):
        place_instance("GPU", 0, "cuda", "0,1;2,3;4,5;6,7", 2, visible=lambda: 4)


def test_gpu_instance_refuses_a_repository_rendered_for_another_tp_size():
    with pytest.raises(PlacementError, match="another tensor-parallel size than the bundle's engine.tp_size 4"):
        place_instance("GPU", 0, "cuda", "0,1;2,3", 4, visible=lambda: 8)
    with pytest.raises(PlacementError, match="no instance_gpus entry starts there"):
        place_instance("GPU", 1, "cuda", "0,1;2,3", 2, visible=lambda: 8)


def test_cpu_instances_never_ask_for_gpus():
    def no_call():
        raise AssertionError("a CPU layout must not look for GPUs")
    assert place_instance("CPU", 0, "cpu", "", 3, visible=no_call).device == "cpu"
    assert place_instance("CPU", 0, "auto", "", 1, visible=no_call).device == "auto"


def test_auto_on_a_gpu_host_refuses_more_ranks_than_gpus():
    # auto keeps KIND_CPU; on a host with 1 GPU (injected) the engine would take cuda with tp 2
    with pytest.raises(PlacementError, match="engine.tp_size 2 needs 2 GPUs, but 1 are visible"):
        place_instance("CPU", 0, "auto", "", 2, visible=lambda: 1)
    assert place_instance("CPU", 0, "auto", "", 2, visible=lambda: 0).device == "auto"   # CPU host: gloo TP


def test_model_args_reads_tp_size_from_the_bundle(tmp_path):
    m = bundle.Manifest(
        model=ModelConfig(architecture="llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, vocab_size=128, rms_norm_eps=1e-5, rope_theta=1e4,
                          max_position_embeddings=256),
        quantization=bundle.Quantization("none"), engine=bundle.EngineSettings(tp_size=2))
    bundle.write(tmp_path, m)
    args, cfg = _args("GPU", 2, "cuda", "0,1;2,3")
    # stands in for a 4-GPU host
    p = instance_placement(args, cfg, str(tmp_path), visible=lambda: 4)
    assert (p.device, p.gpus) == ("cuda:2", (2, 3))
    with pytest.raises(PlacementError, match="needs 4 GPUs, but 2 are visible"):
        instance_placement(args, cfg, str(tmp_path), visible=lambda: 2)
