"""--yaml-cfg: a YAML file gives the same validated arguments as the equivalent command line, in the flat layout and
in Megatron-LM's model_parallel:/language_model: layout; flags still override it; every bad file is reported."""

import textwrap

import pytest
import yaml

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.training.arguments import parse_args_list, validate_args
from megatron.training.yaml_arguments import (
    core_config_from_args,
    core_transformer_config_from_yaml,
    env_constructor,
    load_yaml,
    validate_yaml,
)
from tests.unit_tests.training.test_arguments import BASE, QUIET, without

QUIET_YAML = """
distributed_backend: gloo
masked_softmax_fusion: false
bias_gelu_fusion: false
bias_swiglu_fusion: false
bias_dropout_fusion: false
gradient_accumulation_fusion: false
no_persist_layer_norm: true
apply_rope_fusion: false
"""


def write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def validated(argv, world_size=1):
    args = parse_args_list(argv)
    args.world_size = world_size
    return validate_args(args)


def comparable(args):
    settings = vars(args).copy()
    settings.pop("yaml_cfg")
    return settings


def test_flat_yaml_equals_the_command_line(tmp_path):
    path = write(
        tmp_path,
        textwrap.dedent("""
        num_layers: 4
        hidden_size: 64
        num_attention_heads: 4
        seq_length: 32
        max_position_embeddings: 32
        micro_batch_size: 2
        train_iters: 10
        lr: 1.0e-3
        min_lr: 1e-5            # PyYAML reads this as a string; the flag's type makes it a float
        mock_data: true
        tokenizer_type: NullTokenizer
        vocab_size: 100
        attention_backend: flash
        lr_decay_style: cosine
        eval_iters: 0
        override_opt_param_scheduler: true
        """)
        + QUIET_YAML,
    )
    from_yaml = validated(["--yaml-cfg", path])
    from_cli = validated(
        BASE
        + [
            "--min-lr",
            "1e-5",
            "--attention-backend",
            "flash",
            "--lr-decay-style",
            "cosine",
            "--eval-iters",
            "0",
            "--override-opt-param-scheduler",
        ]
    )
    assert comparable(from_yaml) == comparable(from_cli)
    assert from_yaml.yaml_cfg == path
    assert from_yaml.attention_backend is AttnBackend.flash


def test_megatron_sections_equal_the_command_line(tmp_path):
    path = write(
        tmp_path,
        textwrap.dedent("""
        language_model:
          num_layers: 4
          hidden_size: 64
          num_attention_heads: 4
          num_query_groups: 2          # grouped-query attention, as in Megatron-LM's YAML
          ffn_hidden_size: null
          layernorm_epsilon: 1.e-6
          layernorm_zero_centered_gamma: true
          activation_func: swiglu
          gated_linear_unit: true
          add_bias_linear: false
          normalization: RMSNorm
          init_method: null            # null: keep the default
          apply_query_key_layer_scaling: false
          memory_efficient_layer_norm: false   # the field's default: accepted, changes nothing
          persist_layer_norm: false
          hidden_dropout: 0.0
        model_parallel:
          tensor_model_parallel_size: 2
          pipeline_model_parallel_size: 1
          sequence_parallel: true
          bf16: true
          params_dtype: null
          timers: null
          seq_length: 32               # a plain argument inside a section, as Megatron-LM merges them
        micro_batch_size: 2
        global_batch_size: 8
        rampup_batch_size: [2, 2, 100]
        train_samples: 1000
        lr: 1.0e-3
        mock_data: true
        tokenizer_type: NullTokenizer
        vocab_size: 100
        position_embedding_type: rope
        data_path: null
        """)
        + QUIET_YAML,
    )
    from_yaml = validated(["--yaml-cfg", path], world_size=2)
    cli = [item for item in BASE if item not in ("--train-iters", "10", "--max-position-embeddings")]
    cli.remove("32")  # the --max-position-embeddings value: rope defaults it to --seq-length
    from_cli = validated(
        cli
        + [
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--norm-epsilon",
            "1e-6",
            "--apply-layernorm-1p",
            "--swiglu",
            "--disable-bias-linear",
            "--normalization",
            "RMSNorm",
            "--hidden-dropout",
            "0.0",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--bf16",
            "--global-batch-size",
            "8",
            "--rampup-batch-size",
            "2",
            "2",
            "100",
            "--train-samples",
            "1000",
            "--position-embedding-type",
            "rope",
        ],
        world_size=2,
    )
    assert comparable(from_yaml) == comparable(from_cli)
    assert from_yaml.rampup_batch_size == [2, 2, 100]


def test_command_line_flags_override_the_file(tmp_path):
    path = write(tmp_path, "seed: 7\nlr: 0.5\nsequence_parallel: true\n")
    args = parse_args_list(["--yaml-cfg", path, "--seed", "9"])
    assert (args.seed, args.lr, args.sequence_parallel) == (9, 0.5, True)


def test_environment_variables_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("RUN_DIR", "/runs/a")
    path = write(tmp_path, 'save: ${RUN_DIR}/ckpt\ntensorboard_dir: "${RUN_DIR}/tb"\n')
    args = parse_args_list(["--yaml-cfg", path])
    assert (args.save, args.tensorboard_dir) == ("/runs/a/ckpt", "/runs/a/tb")


def test_load_yaml_and_an_empty_file(tmp_path):
    args = load_yaml(write(tmp_path, "# nothing set\n"))
    assert (args.seed, args.num_layers, args.world_size) == (1234, None, 1)


def test_yaml_is_validated_like_the_command_line(tmp_path):
    path = write(tmp_path, "fp16: true\nmodel_parallel:\n  bf16: true\n")
    args = parse_args_list(["--yaml-cfg", path] + BASE)
    with pytest.raises(ValueError, match="--fp16 and --bf16 are both set; choose one"):
        validate_args(args)


@pytest.mark.parametrize(
    "text, message",
    [
        ("num_layer: 4\n", r"unknown setting num_layer; did you mean num_layers\?"),
        ("language_model:\n  num_layer: 4\n", r"unknown setting language_model.num_layer; did you mean num_layers"),
        (
            "model_parallel:\n  cpu_offloading_weights: true\n",
            r"model_parallel.cpu_offloading_weights: True cannot be set here "
            r"\(the field has no command-line equivalent",
        ),
        ("sequence_parallel: 1\n", "sequence_parallel: must be true or false, got 1"),
        ("num_layers: 2.5\n", r"num_layers: 2.5 is not a valid value \(expected int\)"),
        ("lr: fast\n", r"lr: 'fast' is not a valid value"),
        ("attention_backend: cudnn\n", r"attention_backend: 'cudnn' is not a valid value \(invalid choice"),
        ("normalization: BatchNorm\n", "normalization: 'BatchNorm' is not one of LayerNorm, RMSNorm"),
        ("model_parallel: 4\n", "section model_parallel: must be a mapping of settings, got 4"),
        ("- a\n- b\n", "the file must hold a mapping of settings, got list"),
        ("num_layers: [1\n", "not valid YAML"),
        ("save: ${NO_SUCH_VARIABLE_HERE}/x\n", r"environment variable NO_SUCH_VARIABLE_HERE \(in '\$\{NO_SUCH"),
        ("seed: 1\nlanguage_model:\n  seed: 2\n", "language_model.seed and seed set seed to different values"),
        ("language_model:\n  activation_func: relu\n", "activation_func: 'relu' is not one of"),
        ("language_model:\n  gated_linear_unit: true\n", "a gated MLP comes with activation_func: swiglu here"),
    ],
)
def test_bad_settings_name_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as error:
        parse_args_list(["--yaml-cfg", path])
    assert path in str(error.value)


def test_missing_file():
    with pytest.raises(ValueError, match="--yaml-cfg /no/such/config.yaml: file not found"):
        parse_args_list(["--yaml-cfg", "/no/such/config.yaml"])


def test_quiet_flags_match_the_quiet_yaml(tmp_path):
    assert vars(parse_args_list(QUIET)) == vars(parse_args_list(["--yaml-cfg", write(tmp_path, QUIET_YAML)])) | {
        "yaml_cfg": None
    }


def test_megatron_lms_yaml_helpers(tmp_path, monkeypatch):
    path = write(tmp_path, "language_model:\n  num_layers: 2\n  hidden_dropout: 0.0\n" + QUIET_YAML)
    flags = [item for item in without("--num-layers") if item not in QUIET]  # the file gives num_layers
    args = validate_yaml(parse_args_list(["--yaml-cfg", path] + flags))
    assert (args.num_layers, args.hidden_dropout, args.data_parallel_size) == (2, 0.0, 1)
    config = core_transformer_config_from_yaml(args)
    assert (config.num_layers, config.hidden_dropout) == (2, 0.0)
    with pytest.raises(ValueError, match="read from the language_model section"):
        core_transformer_config_from_yaml(args, "encoder")
    fields = core_config_from_args(args, ModelParallelConfig)
    assert (fields["tensor_model_parallel_size"], fields["bf16"]) == (1, False)
    assert "num_layers" not in fields  # a TransformerConfig field, not a ModelParallelConfig one

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!env", env_constructor)
    monkeypatch.setenv("RUN_DIR", "/runs/b")
    assert yaml.load("save: !env ${RUN_DIR}/ckpt", Loader=Loader) == {"save": "/runs/b/ckpt"}
    with pytest.raises(ValueError, match=r"environment variable NOT_SET_HERE \(in '\$\{NOT_SET_HERE\}'\) is not set"):
        yaml.load("save: !env ${NOT_SET_HERE}", Loader=Loader)
