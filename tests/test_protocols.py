import dataclasses

import pytest
import torch

from keel.connectors import (
    KVConnectorMetadata,
    KVConnectorRequest,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from keel.endpoint import Endpoint, EndpointContext
from keel.io import EnginePrompt, IOProcessor
from keel.plugins.hookspecs import KeelHookSpecs, hookimpl, new_plugin_manager
from keel.plugins.loader import load_plugins
from keel.quantization import (
    LinearLayerSpec,
    QuantizationError,
    QuantizationMethod,
    QuantizationRequest,
    UnquantizedLinearMethod,
    resolve_quantization,
)


def test_growable_inputs_are_frozen():
    for obj in (LinearLayerSpec("p", 4, (2, 2), torch.float32), KVConnectorRequest("r", (1, 2), 0),
                EnginePrompt(prompt="hi"), EndpointContext(None, None, "m")):
        field = dataclasses.fields(obj)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, None)


def test_unquantized_linear_method():
    method = UnquantizedLinearMethod()
    assert isinstance(method, QuantizationMethod)
    module = torch.nn.Module()
    method.create_weights(module, LinearLayerSpec("proj", input_size=4, output_partition_sizes=(3, 2),
                                                  params_dtype=torch.float32))
    assert module.weight.shape == (5, 4)
    torch.nn.init.normal_(module.weight)
    method.process_weights_after_loading(module)
    x = torch.randn(3, 4)
    torch.testing.assert_close(method.apply(module, x), x @ module.weight.T)


def test_quantization_config_lookup(fake_plugins):
    quant = """
        class Fp8Config:
            name = "fp8"

            def __init__(self, raw):
                self.raw = raw

            @classmethod
            def from_config(cls, config):
                return cls(config)

            @classmethod
            def from_online(cls):
                return cls({"online": True})

            def validate(self, request):
                return [] if request.device_type == "cpu" else ["needs the CPU"]

        class GPTQConfig(Fp8Config):
            name = "gptq"
            from_online = None
    """
    fake_plugins("quant-fake", provides={"quantization": {"fp8": "PKG.q:Fp8Config", "gptq": "PKG.q:GPTQConfig"}},
                 files={"q.py": quant})
    plugins = load_plugins(["quant-fake"])

    from types import SimpleNamespace

    cpu = QuantizationRequest("cpu", "cpu", torch.float32)
    cfg = SimpleNamespace(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    got = resolve_quantization(cfg, None, plugins, cpu, {"qkv_proj": ["q_proj"]})
    assert got.raw["weight_block_size"] == [128, 128] and got.packed_modules_mapping == {"qkv_proj": ["q_proj"]}
    assert resolve_quantization(object(), None, plugins, cpu) is None
    assert resolve_quantization(object(), "fp8", plugins, cpu).raw == {"online": True}
    with pytest.raises(QuantizationError, match="did you mean 'fp8'"):
        resolve_quantization(SimpleNamespace(quantization_config={"quant_method": "fp9"}), None, plugins, cpu)
    with pytest.raises(QuantizationError, match="requested but the checkpoint is quantized with 'fp8'"):
        resolve_quantization(cfg, "gptq", plugins, cpu)
    with pytest.raises(QuantizationError, match="'gptq' needs a checkpoint quantized with it"):
        resolve_quantization(object(), "gptq", plugins, cpu)
    with pytest.raises(QuantizationError, match="'fp8' cannot run on platform 'x'.*needs the CPU"):
        resolve_quantization(cfg, None, plugins, QuantizationRequest("x", "xpu", torch.float32))


def test_connector_both_sides_are_structural():
    class Sched:
        def get_num_new_matched_tokens(self, request):
            return 0, False

        def update_state_after_alloc(self, request, num_external_tokens): ...
        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def request_finished(self, request):
            return False, None

    class Work:
        def register_kv_caches(self, kv_caches): ...
        def start_load_kv(self, metadata, forward_context): ...
        def wait_for_layer_load(self, layer_name): ...
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata): ...
        def wait_for_save(self): ...
        def get_finished(self, finished_req_ids):
            return set(), set()

    assert isinstance(Sched(), KVConnectorScheduler) and not isinstance(Sched(), KVConnectorWorker)
    assert isinstance(Work(), KVConnectorWorker)
    assert {r.value for r in KVConnectorRole} == {"scheduler", "worker"}
    assert KVConnectorRequest("r", (1,), 0, num_tentative_tokens=2).num_tentative_tokens == 2


def test_io_processor_and_endpoint_are_structural():
    class Echo:
        def parse_request(self, payload):
            return payload

        def pre_process(self, request):
            return [EnginePrompt(prompt=request["text"])]

        def post_process(self, request, outputs):
            return {"n": len(outputs)}

    class Hello:
        def register(self, app, ctx):
            app["/hello"] = ctx.served_model_name

    assert isinstance(Echo(), IOProcessor) and isinstance(Hello(), Endpoint)
    app = {}
    Hello().register(app, EndpointContext(engine_client=None, config=None, served_model_name="m"))
    assert app == {"/hello": "m"}


def test_hookspecs_cover_lifecycle():
    names = {n for n in vars(KeelHookSpecs) if n.startswith("keel_")}
    assert names == {"keel_add_cli_options", "keel_adjust_config", "keel_engine_start", "keel_worker_init",
                     "keel_request_finished", "keel_shutdown"}
    calls = []

    class Impl:
        @hookimpl
        def keel_request_finished(self, request_id):  # a subset of the arguments is fine
            calls.append(request_id)

    pm = new_plugin_manager()
    pm.register(Impl())
    pm.hook.keel_request_finished(request_id="r1", reason="stop")
    assert calls == ["r1"]
