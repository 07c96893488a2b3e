"""`gqakit uptrain --plan` and the fit check: exact parameter counts of 7B- and 70B-shaped Llamas built
on the meta device, per-rank bytes against figures worked out by hand here, and the arithmetic checked
against what torch really holds for a tiny model (parameters, gradients, AdamW state, saved activations)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from gqakit.cli import main
from gqakit.common.errors import GqakitError
from gqakit.uptrain.config import UptrainConfig
from gqakit.uptrain.memory_plan import check_fits, parse_device_memory, plan_memory

GB = 10**9
N7 = 6_738_415_616  # Llama-2-7B
N70 = 68_976_648_192  # Llama-2-70B (8 K/V heads)
LAYER7 = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096  # q, k, v, o + gate, up, down + two norms
ROOT7 = 2 * 32000 * 4096 + 4096  # embeddings, untied head, final norm
LAYER70 = 2 * 8192**2 + 2 * 8192 * (8 * 128) + 3 * 8192 * 28672 + 2 * 8192  # q, o + k, v of 8 heads + MLP + norms
ROOT70 = 2 * 32000 * 8192 + 8192


def _llama(path, **kw) -> str:
    from transformers import LlamaConfig

    LlamaConfig(architectures=["LlamaForCausalLM"], max_position_embeddings=4096, **kw).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """config.json only: no weights, no tokenizer."""
    root = tmp_path_factory.mktemp("configs")
    big = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
               num_attention_heads=64)
    return {"7b": _llama(root / "llama-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
            "70b": _llama(root / "llama-70b", num_key_value_heads=8, **big),
            "70b-mha": _llama(root / "llama-70b-mha", num_key_value_heads=64, **big)}


def _cfg(model: str, **kw) -> UptrainConfig:
    kw = {"seq_len": 4096, "batch_size": 1, **kw}
    return UptrainConfig(model=model, output_dir="/nonexistent/run", **kw)


def test_parameter_counts_are_exact_on_the_meta_device(models):
    assert LAYER7 == 202_383_360 and ROOT7 + 32 * LAYER7 == N7
    assert LAYER70 == 855_654_400 and ROOT70 + 80 * LAYER70 == N70
    for name, total, layer, root in (("7b", N7, LAYER7, ROOT7), ("70b", N70, LAYER70, ROOT70)):
        m = plan_memory(_cfg(models[name]), 1).model
        assert (m.total, m.layer, m.root) == (total, layer, root)
        assert m.trainable["all"] == total


def test_7b_ddp_needs_16_bytes_per_parameter_and_fsdp_on_8_ranks_an_eighth(models):
    ddp = plan_memory(_cfg(models["7b"]), 8, 80 * GB)
    # fp32 weights 4 B/param, fp32 gradients 4, AdamW's two fp32 moments 8: 16 B/param on every rank
    assert (ddp["parameters"], ddp["gradients"], ddp["optimizer"]) == (4 * N7, 4 * N7, 8 * N7)
    assert ddp.state == 16 * 6_738_415_616 == 107_814_649_856 > 80 * GB
    assert ddp["ddp buckets"] == 4 * N7  # DDP's second copy of the gradients (gradient_as_bucket_view=False)
    assert ddp["adamw step"] == 4 * N7  # foreach AdamW's sqrt(exp_avg_sq), during the step only
    # the peak: what is always there (weights, moments, buckets: 16 B/param) + the larger of forward/backward
    # (activations + logits, 46.4 GB) and the optimizer step (gradients + its temporary, 8 B/param = 53.9 GB)
    assert ddp["activations"] + ddp["logits"] == 46_352_318_464 < 8 * N7
    assert ddp.total == 16 * N7 + 8 * N7 == 161_721_974_784
    assert ddp.fits is False
    assert plan_memory(_cfg(models["7b"]), 1)["ddp buckets"] == 0  # one process: no DDP wrapper

    fsdp = plan_memory(_cfg(models["7b"], sharding="fsdp", mixed_precision="bf16"), 8, 80 * GB)
    # every tensor's rows (4,096, 11,008, 32,000) divide by 8: each rank holds exactly an eighth
    assert fsdp.state == 107_814_649_856 // 8 == 13_476_831_232
    assert fsdp["ddp buckets"] == 0
    # bf16 gathers: the root (never resharded after forward) + 2 decoder layers, and 1 layer's fp32 gradient
    assert fsdp["fsdp gather"] == 2 * (262_148_096 + 2 * 202_383_360) + 4 * 202_383_360 == 2_143_363_072
    assert fsdp.fits is True
    # 70B over 64 ranks: rows 8,192, 1,024, 28,672 and 32,000 all divide by 64
    big = plan_memory(_cfg(models["70b"], sharding="fsdp"), 64)
    assert big.state == 16 * N70 // 64 == 17_244_162_048


def test_activations_follow_the_per_layer_formula(models):
    """7B, 1 x 4,096 tokens. h = 4,096, 32 heads (a) = 32 K/V heads (g) of d = 128, I = 11,008, V = 32,000."""
    h, a, g, d, inter, L, n, V = 4096, 32, 32, 128, 11008, 32, 4096, 32000
    # fsdp + bf16: everything in bf16 (s = c = 2). Per token, per layer:
    norm = 4 * h + 4 + 2 * h  # fp32 upcast input + fp32 rsqrt + bf16 normalised input (weight's gradient)
    layer = (2 * norm + 2 * h + 2 * h  # two norms; q/k/v's and gate/up's shared input, once each
             + (2 * a * d + 2 * g * d) * 2 + 4 * a  # q, k, v, attention output (bf16) + fp32 logsumexp
             + 4 * inter * 2)  # gate output, SiLU output, up output, their product
    final = norm + 2 * h  # final norm + lm_head's input
    assert (norm, layer, final) == (24_580, 186_504, 32_772)
    plan = plan_memory(_cfg(models["7b"], sharding="fsdp", mixed_precision="bf16"), 8)
    assert plan["activations"] == n * (L * layer + final) == 24_579_686_400
    ckpt = plan_memory(_cfg(models["7b"], sharding="fsdp", mixed_precision="bf16", gradient_checkpointing=True), 8)
    # checkpointing keeps each layer's bf16 input and recomputes one layer in backward
    assert ckpt["activations"] == n * (L * h * 2 + layer + final) == 1_971_896_320
    assert plan.other_activations.bytes == ckpt["activations"]
    # the logits: fp32 log-probabilities kept by cross-entropy + two fp32 gradients in backward
    assert plan["logits"] == 12 * n * V == 1_572_864_000

    # ddp + bf16: autocast over fp32 weights; the residual stream and norms stay fp32 (s = 4), and each
    # trainable projection keeps its own bf16 cast of its input (3 for q/k/v, 2 for gate/up, 1 for lm_head)
    norm32 = 4 * h + 4 + 4 * h
    layer_ac = 2 * norm32 + 3 * h * 2 + 2 * h * 2 + (2 * a * d + 2 * g * d) * 2 + 4 * a + 4 * inter * 2
    ac = plan_memory(_cfg(models["7b"], mixed_precision="bf16"), 8)
    assert ac["activations"] == n * (L * layer_ac + norm32 + h * 2) == n * 7_319_812
    # autocast's bf16 copies of every Linear weight: 32 layers' projections + the head
    assert ac["autocast copies"] == 2 * (32 * (4 * 4096**2 + 3 * 4096 * 11008) + 32000 * 4096) == 13_214_154_752


def test_context_parallel_divides_the_per_rank_tokens(models):
    one = plan_memory(_cfg(models["7b"], sharding="fsdp", mixed_precision="bf16"), 8)
    ring = plan_memory(_cfg(models["7b"], sharding="fsdp", mixed_precision="bf16", context_parallel=4), 8)
    assert ring["activations"] * 4 == one["activations"] == 4096 * 6_000_900
    assert ring["activations"] == 1024 * 6_000_900 and ring["logits"] == 12 * 1024 * 32000
    assert ring.state == one.state  # the ring's ranks shard the weights too: the mesh is the whole world
    with pytest.raises(GqakitError, match="context_parallel=3 does not divide 8 processes"):
        plan_memory(_cfg(models["7b"], context_parallel=3), 8)


def test_trainable_kv_shrinks_gradients_and_optimizer_to_the_kv_projections(models):
    kv7 = 32 * 2 * 4096 * 4096  # k_proj and v_proj of 32 layers, 32 heads x 128 each
    assert kv7 == 1_073_741_824
    plan = plan_memory(_cfg(models["7b"], trainable="kv"), 1)
    assert (plan["parameters"], plan["gradients"], plan["optimizer"]) == (4 * N7, 4 * kv7, 8 * kv7)
    fsdp = plan_memory(_cfg(models["7b"], trainable="kv", sharding="fsdp"), 8)
    assert (fsdp["parameters"], fsdp["gradients"], fsdp["optimizer"]) == (4 * N7 // 8, 4 * kv7 // 8, 8 * kv7 // 8)
    kv70 = 80 * 2 * 8192 * 1024  # 8 K/V heads of 128
    assert plan_memory(_cfg(models["70b"], trainable="kv"), 1)["gradients"] == 4 * kv70 == 4 * 1_342_177_280


def test_fsdp_with_accumulation_holds_unsharded_gradients(models):
    """While gradient sync is off (every micro-step but the last), FSDP2 accumulates UNSHARDED gradients
    in its reduce dtype (fp32): the whole model's on every rank, and they live through forward and backward."""
    once = plan_memory(_cfg(models["7b"], sharding="fsdp", mixed_precision="bf16"), 8)
    twice = plan_memory(_cfg(models["7b"], sharding="fsdp", mixed_precision="bf16", gradient_accumulation_steps=2), 8)
    assert once["fsdp no-sync"] == 0 and twice["fsdp no-sync"] == 4 * N7
    # and the sharded gradients stay across micro-steps: they count with the activations
    backward = twice["fsdp gather"] + twice["activations"] + twice["logits"] + twice["fsdp no-sync"]
    assert twice.total == twice["parameters"] + twice["optimizer"] + backward + twice["gradients"]
    assert twice.total - once.total == 4 * N7 + twice["gradients"]


def test_teacher_line(models):
    mha_layer = 4 * 8192**2 + 3 * 8192 * 28672 + 2 * 8192  # the MHA original: k, v as large as q
    teacher = ROOT70 + 80 * mha_layer
    assert teacher == 78_371_889_152
    plan = plan_memory(_cfg(models["70b"], teacher=models["70b-mha"], sharding="fsdp", mixed_precision="bf16"), 64)
    assert plan.teacher.total == teacher
    assert plan["teacher"] == 4 * teacher // 64 == 4_898_243_072  # fp32, sharded like the student
    # bf16 gathers: both roots (the teacher's stays gathered after its no_grad forward) + 2 of the larger layers
    assert plan["fsdp gather"] == 2 * (2 * ROOT70 + 2 * mha_layer) + 4 * LAYER70
    assert plan["distillation"] == (2 + 28) * 4096 * 32000  # teacher's bf16 logits + the KL's 7 fp32 tensors
    ddp = plan_memory(_cfg(models["70b"], teacher=models["70b-mha"]), 8)
    assert ddp["teacher"] == 4 * teacher


def test_a_plan_that_does_not_fit_is_refused_with_the_numbers_and_the_fix(models):
    with pytest.raises(GqakitError) as e:
        check_fits(_cfg(models["7b"]), 8, 80 * GB)
    msg = str(e.value)
    assert "\n" not in msg and "161.72 GB per rank at its peak" in msg and "the device has 80.00 GB" in msg
    assert "optimizer 53.91" in msg and "ddp buckets 26.95" in msg
    # checkpointing would not lower this peak (the optimizer step's): only the changes that help are named
    assert msg.endswith("fits with any one of: sharding=fsdp (59.94 GB); trainable=kv (73.78 GB)")

    with pytest.raises(GqakitError) as e:  # fsdp on 8 ranks, 8 x 4,096 tokens of fp32 activations per rank
        check_fits(_cfg(models["7b"], sharding="fsdp", batch_size=8), 8, 80 * GB)
    assert "fits with any one of: gradient_checkpointing=true (56.10 GB); context_parallel=8 (59.94 GB); " \
           "not enough alone: mixed_precision=bf16 (221.47 GB)" in str(e.value)

    with pytest.raises(GqakitError) as e:  # 70B: no single change is enough
        check_fits(_cfg(models["70b"]), 8, 80 * GB)
    assert str(e.value).endswith("no single change fits (sharding=fsdp (356.80 GB); trainable=kv (462.79 GB)); "
                                 "together sharding=fsdp + gradient_checkpointing=true on 32 processes fit (53.93 GB)")
    with pytest.raises(GqakitError, match="nothing gqakit can change fits .* use devices with more memory"):
        check_fits(_cfg(models["70b"]), 1, 10**6)

    assert check_fits(_cfg(models["7b"], sharding="fsdp", mixed_precision="bf16"), 8, 80 * GB).fits
    assert check_fits(_cfg(models["7b"], sharding="fsdp", device_memory="80GB"), 8).device_memory == 80 * GB


def test_absurd_sizes_are_planned_in_a_bounded_number_of_evaluations(models, monkeypatch):
    """--plan and the pre-run fit check are arithmetic: the plan is evaluated a number of times that does not grow
    with the batch size or the sequence length (counted, not timed: the smallest batch that fits is bisected)."""
    from gqakit.uptrain import memory_plan

    calls = []
    real = memory_plan._total
    monkeypatch.setattr(memory_plan, "_total", lambda *a: calls.append(1) or real(*a))
    checked = 0
    for name, batch_size, seq_len, sharding in (("70b", 10**9, 4096, "ddp"), ("70b", 10**5, 10**7, "ddp"),
                                                ("7b", 10**6, 256, "fsdp"), ("7b", 3, 2, "ddp")):
        calls.clear()
        plan = plan_memory(_cfg(models[name], batch_size=batch_size, seq_len=seq_len, sharding=sharding), 8, 80 * GB)
        assert len(calls) < 200, (batch_size, seq_len, len(calls))
        smaller = [f for f in plan.fixes if f.change.startswith("batch_size=")]
        if batch_size > 1 and smaller:  # the bisection finds the largest micro-batch that fits, as a scan would
            b = int(smaller[0].change.split()[0].split("=")[1])
            model = memory_plan.count_model(models[name])

            def fits(n: int) -> bool:  # the same global batch in micro-batches of n
                cfg = _cfg(models[name], batch_size=n, seq_len=seq_len, sharding=sharding,
                           gradient_accumulation_steps=-(-batch_size // n))
                return memory_plan._total(cfg, 8, model, None) <= 80 * GB

            assert b == 1 or (fits(b) and not fits(b + 1))
            checked += b > 1
    assert checked  # at least one case bisected to a micro-batch above 1


def test_device_memory_from_the_recipe_or_this_machine(models, monkeypatch):
    with pytest.raises(GqakitError, match=r"the device has 25\.77 GB \(device_memory=24GiB\)"):
        check_fits(_cfg(models["7b"], device_memory="24GiB"), 1)
    with pytest.raises(GqakitError, match="is not a size"):
        check_fits(_cfg(models["7b"], device_memory="lots"), 1)
    if not torch.cuda.is_available():  # CPU: MemAvailable shared by the node's processes
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        with pytest.raises(GqakitError, match=r"available memory / 2 local process"):
            check_fits(_cfg(models["70b"]), 2)


@pytest.mark.parametrize("text, nbytes", [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("24 gib", 24 * 2**30),
                                          ("512MB", 512 * 10**6), ("1.5TB", 15 * 10**11), ("1e9", 10**9),
                                          (4096, 4096)])
def test_parse_size(text, nbytes):
    assert parse_device_memory(text) == nbytes


@pytest.mark.parametrize("text", ["80XB", "-1GB", "GB", "0", "", "80 G B", True])
def test_parse_size_refuses(text):
    with pytest.raises(GqakitError, match="write e.g. 80GB"):
        parse_device_memory(text)


def _recipe(tmp_path, model: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(f"model: {model}\noutput_dir: {tmp_path / 'run'}\ndata: [{tmp_path / 'absent.txt'}]\n"
                    "steps: 10\nseq_len: 4096\nbatch_size: 1\n")
    return str(path)


def test_cli_plan_prints_the_table_and_writes_nothing(models, tmp_path, capsys):
    """--plan needs only the models' config.json: the data files and a tokenizer may be absent."""
    recipe = _recipe(tmp_path, models["7b"])
    before = sorted(tmp_path.rglob("*"))
    assert main(["uptrain", recipe, "--plan", "--processes", "8", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "8 processes, sharding=ddp" in out and "per rank" in out
    for row in ("parameters        26.95  always", "optimizer         53.91  always", "total            161.72  peak",
                "device memory     80.00"):
        assert row in out
    assert "does not fit: 81.72 GB over; fits with any one of: sharding=fsdp (" in out
    assert main(["uptrain", recipe, "sharding=fsdp", "mixed_precision=bf16", "--plan", "--processes", "8",
                 "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "sharded over 8" in out and "fsdp gather" in out and "fits: 41.60 GB to spare" in out
    assert sorted(tmp_path.rglob("*")) == before  # no run folder, nothing else


def test_cli_bad_plan_arguments_exit_2_in_one_line(models, tmp_path, capsys):
    recipe = _recipe(tmp_path, models["7b"])
    assert main(["uptrain", recipe, "--plan", "--device-memory", "80XB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'80XB' is not a size" in err
    assert main(["uptrain", recipe, "--processes", "8"]) == 2
    assert "--processes only applies with --plan" in capsys.readouterr().err
    assert main(["uptrain", recipe, "num_processes=4", "--plan", "--processes", "8"]) == 2  # a launch it refuses
    assert "--processes 8 plans a launch that the recipe's num_processes=4 refuses" in capsys.readouterr().err
    assert main(["uptrain", recipe, "num_processes=8", "--plan", "--processes", "8"]) == 0
    capsys.readouterr()
    assert main(["uptrain", recipe, "--plan", "--force"]) == 2  # nothing for it to start over
    assert "--force does nothing with --plan" in capsys.readouterr().err
    assert main(["uptrain", recipe, "force=true", "--plan"]) == 2  # the same, typed as an override
    assert "--force does nothing with --plan" in capsys.readouterr().err


def _tiny_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, architectures=["LlamaForCausalLM"])
    return LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("trainable", ["all", "kv"])
def test_state_lines_equal_the_bytes_of_a_real_optimizer_step(tmp_path, trainable):
    """The arithmetic against reality: after one AdamW step, the bytes of p, p.grad, exp_avg and
    exp_avg_sq of an actual model equal the plan's lines (tied embeddings counted once)."""
    from transformers import AutoModelForCausalLM

    from gqakit.uptrain.modeling import make_optimizer, select_trainable

    config, teacher_config = _tiny_config(tie_word_embeddings=True), _tiny_config(num_key_value_heads=4)
    config.save_pretrained(tmp_path / "student")
    teacher_config.save_pretrained(tmp_path / "teacher")
    cfg = UptrainConfig(model=str(tmp_path / "student"), output_dir=str(tmp_path / "run"), trainable=trainable,
                        teacher=str(tmp_path / "teacher"), batch_size=2, seq_len=16)
    plan = plan_memory(cfg, 1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    select_trainable(model, trainable)
    optimizer = make_optimizer(model, cfg.lr, cfg.betas, cfg.weight_decay)
    ids = torch.randint(0, 96, (2, 17))
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    optimizer.step()
    params = list(model.parameters())  # each tensor once
    assert sum(p.nbytes for p in params) == plan["parameters"]
    assert sum(p.grad.nbytes for p in params if p.grad is not None) == plan["gradients"]
    moments = [s for p in params for k, s in optimizer.state[p].items() if k in ("exp_avg", "exp_avg_sq")]
    assert sum(s.nbytes for s in moments) == plan["optimizer"]
    teacher = AutoModelForCausalLM.from_config(copy.deepcopy(teacher_config))
    assert sum(p.nbytes for p in teacher.parameters()) == plan["teacher"]


def _saved_bytes(model, ids, autocast: bool) -> int:
    """Bytes of the tensors autograd saves for backward during a forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        model(input_ids=ids, use_cache=False)
    return sum(saved.values())


@pytest.mark.parametrize("trainable, sharding, mixed_precision", [
    ("all", "ddp", "no"), ("kv", "ddp", "no"),  # fp32
    ("all", "fsdp", "bf16"), ("kv", "fsdp", "bf16"),  # FSDP2's bf16 policy: bf16 parameters in compute
    ("all", "ddp", "bf16"),  # autocast over fp32 weights
])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_formula_matches_what_autograd_saves(tmp_path, trainable, sharding, mixed_precision,
                                                        checkpointing):
    """The activations line against the tensors torch keeps for backward in a tiny Llama's forward.
    Differences, worked out: the RoPE tables (cos and sin, T x d each, shared by all layers and the
    batch) and, when the embeddings train, the token ids (int64), which the plan leaves out."""
    from transformers import AutoModelForCausalLM

    from gqakit.uptrain.modeling import select_trainable

    B, T, d = 4, 64, 16
    config = _tiny_config(vocab_size=256, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=d)
    config.save_pretrained(tmp_path / "tiny")
    cfg = UptrainConfig(model=str(tmp_path / "tiny"), output_dir=str(tmp_path / "run"), trainable=trainable,
                        sharding=sharding, mixed_precision=mixed_precision, batch_size=B, seq_len=T,
                        gradient_checkpointing=checkpointing)
    plan = plan_memory(cfg, 1)
    bf16_params = sharding == "fsdp" and mixed_precision == "bf16"
    autocast = sharding == "ddp" and mixed_precision == "bf16"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to(torch.bfloat16 if bf16_params else torch.float32)
    select_trainable(model, trainable)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    got = _saved_bytes(model, torch.randint(0, 256, (B, T)), autocast)
    ids = 8 * B * T if trainable == "all" else 0
    if not checkpointing:
        rope = 2 * T * d * (2 if bf16_params else 4)
        # autocast's bf16 weight copies are saved tensors too: the plan's "autocast copies" line
        assert got == plan["activations"] + plan["autocast copies"] + rope + ids
    else:  # the forward keeps each layer's input; one layer's activations come back in backward
        h, a, g, inter, every = 64, 4, 2, 176, trainable == "all"
        c, s = (2 if mixed_precision == "bf16" else 4), (2 if bf16_params else 4)
        norm = 4 * h + 4 + (h * s if every else 0)

        def feed(k):  # the input that k trainable projections keep for their weight gradients
            return 0 if k == 0 else k * h * c if autocast else h * s

        layer = (2 * norm + feed(3 if every else 2) + feed(2 if every else 0) + (2 * a * d + 2 * g * d) * c + 4 * a
                 + 3 * inter * c + (inter * c if every else 0))
        head_copy = 2 * 256 * 64 if autocast else 0  # lm_head's bf16 weight copy (in the autocast copies line)
        assert got == plan["activations"] - B * T * layer + ids + head_copy


@pytest.mark.parametrize("checkpointing", [False, True])
def test_total_is_the_measured_peak_of_a_real_step(tmp_path, checkpointing):
    """torch's MemTracker follows every tensor a tiny Llama's training step allocates (weights, AdamW
    state, gradients, activations, temporaries): the plan's total is at its peak, or a little above."""
    MemTracker = pytest.importorskip("torch.distributed._tools.mem_tracker").MemTracker
    from transformers import AutoModelForCausalLM

    from gqakit.uptrain.loss import cross_entropy_sum
    from gqakit.uptrain.modeling import make_optimizer

    B, T = 4, 128
    config = _tiny_config(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                          num_key_value_heads=2, head_dim=32)
    config.save_pretrained(tmp_path / "tiny")
    cfg = UptrainConfig(model=str(tmp_path / "tiny"), output_dir=str(tmp_path / "run"), batch_size=B, seq_len=T,
                        gradient_checkpointing=checkpointing)
    plan = plan_memory(cfg, 1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    optimizer = make_optimizer(model, cfg.lr, cfg.betas, cfg.weight_decay)
    seqs = torch.randint(0, 1024, (B, T + 1))

    def step():  # as the loop does it
        optimizer.zero_grad(set_to_none=True)
        cross_entropy_sum(model(input_ids=seqs[:, :-1], use_cache=False).logits, seqs[:, 1:]).backward()
        optimizer.step()

    step()  # AdamW's state exists from the first step on
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert 0.99 * measured <= plan.total <= 1.2 * measured
