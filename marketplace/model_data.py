"""config.json fields of the models Rigshare knows by name, with where each came from.

Verification's first-principles serving prediction, the catalog's "runs this model at this
context" filter and /tools/vram read these (through `architecture_for`). A model that is not
here is still verified: by its fleet peers, by the size its name states, or, with neither, by
measurement alone.
"""

from marketplace import modelmath

# Qwen3.5's hybrid layout: three Gated DeltaNet (linear-attention) layers to one full-attention
# layer, so one layer in four keeps a per-token KV cache; the others keep a recurrent state whose
# matrices are float32 (`mamba_ssm_dtype`), and one multi-token-prediction layer of full
# attention rides along for speculative decoding. Fields as in the published config.json
# (text_config of Qwen3_5ForConditionalGeneration), copied in transformers' and vLLM's Qwen3.5
# tests and model code.
_QWEN35_HYBRID = dict(
    full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, mamba_ssm_dtype="float32",
    mtp_num_hidden_layers=1, max_position_embeddings=262_144, dtype="bfloat16",
    vocab_size=248_320, head_dim=256, num_key_value_heads=4,
)
_QWEN35_27B = dict(
    _QWEN35_HYBRID, num_hidden_layers=64, hidden_size=5120, num_attention_heads=24,
    intermediate_size=17408, linear_num_value_heads=48, tie_word_embeddings=False,
)
_QWEN35_4B = dict(
    _QWEN35_HYBRID, num_hidden_layers=32, hidden_size=2560, num_attention_heads=16,
    intermediate_size=9216, linear_num_value_heads=32,
)

MODELS = {
    # The 27B hybrid of the published fleet measurements (FACTS.md); the fleet simulator
    # serves it as Qwen/Qwen3-27B (an alias below).
    "Qwen/Qwen3.5-27B": dict(
        label="Qwen3.5-27B", config=_QWEN35_27B, params=27e9,
        source="Qwen3.5-27B config.json (64 layers, 16 of full attention with 4 KV heads of 256; "
               "48 Gated DeltaNet layers of 48 value heads); 27B parameters as its model card "
               "states"),
    "Qwen/Qwen3.5-4B": dict(
        label="Qwen3.5-4B", config=_QWEN35_4B, params=4e9,
        source="Qwen3.5-4B config.json (32 layers, 8 of full attention); 4B parameters as its "
               "name states"),
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        label="Llama-3.1-8B",
        config=dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                    vocab_size=128256, max_position_embeddings=131_072),
        params=8.03e9, source="Llama-3.1-8B config.json (FACTS.md: 128 KiB of KV per token)"),
    "mistralai/Mistral-Small-24B-Instruct-2501": dict(
        label="Mistral-Small-24B",
        config=dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, intermediate_size=32768,
                    vocab_size=131072, max_position_embeddings=32_768),
        params=23.6e9, source="Mistral-Small-24B-Instruct-2501 config.json (40 layers, 8 KV "
                              "heads of 128: 160 KiB of KV a token at 16 bits); 23.6B parameters "
                              "as its model card states"),
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(
        label="SmolLM2-135M",
        config=dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                    vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192),
        params=134.5e6, source="SmolLM2-135M config.json (the test engine's model)"),
}
ALIASES = {
    "Qwen/Qwen3-27B": "Qwen/Qwen3.5-27B",
    "meta-llama/Llama-3.1-8B": "meta-llama/Llama-3.1-8B-Instruct",
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


def canonical_name(model_id: str) -> str | None:
    """The MODELS key an engine's model id names (case, organisation and aliases aside)."""
    wanted = (model_id or "").strip().lower()
    if not wanted:
        return None
    names = {name.lower(): name for name in MODELS} | {
        alias.lower(): target for alias, target in ALIASES.items()}
    return names.get(wanted) or next(
        (target for key, target in names.items() if key.rsplit("/", 1)[-1] == wanted
         .rsplit("/", 1)[-1]), None)


def architecture_for(model_id: str) -> modelmath.Architecture | None:
    """The known architecture of an engine's model id (case and organisation aside)."""
    name = canonical_name(model_id)
    if name is None:
        return None
    row = MODELS[name]
    return modelmath.from_config(row["config"], params=row["params"], source=row["source"])


def known_models() -> list[tuple[str, str]]:
    """(id, label) of each known model, for a choice."""
    return [(name, row["label"]) for name, row in MODELS.items()]
