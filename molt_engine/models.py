"""Policies: built-in presets (random init from transformers config classes) with offline tokenizers (characters, or
byte-level BPE with a chat template), or a local HF directory."""
import math
import os

import peft
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer,
                          CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen3MoeConfig)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # Pillow only, no torchvision

from .tokenizer_files import CHAR_TOKENS, CHAT_TOKENIZER, IMAGE_TOKEN

# Architectures only; sizes are chosen so that a CPU learns the built-in envs in minutes.
_DENSE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              tie_word_embeddings=True, pad_token_id=0, bos_token_id=None)  # the text presets' (MoE: attention, embeddings)
PRESETS = {
    "tiny-dense": lambda vocab: LlamaConfig(vocab_size=vocab, max_position_embeddings=512, eos_token_id=1, **_DENSE),
    # 8 experts, top-2, about 1.07M parameters; an expert is small, so a step costs about what tiny-dense costs.
    "tiny-moe": lambda vocab: Qwen3MoeConfig(vocab_size=vocab, moe_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, eos_token_id=1, **_DENSE),
    # The tiny-dense text model behind a 2-layer CLIP tower: a 32x32 image is 4 patches of 16x16, i.e. 4 tokens
    # ("default" strategy drops CLS), one per quadrant of the shapes env. The image placeholder is one token past
    # the char vocabulary.
    "tiny-vlm": lambda vocab: LlavaConfig(
        vision_config=CLIPVisionConfig(image_size=32, patch_size=16, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, projection_dim=64),
        text_config=PRESETS["tiny-dense"](vocab + 1), image_token_id=vocab,
        vision_feature_select_strategy="default", vision_feature_layer=-1, tie_word_embeddings=True),
    # tiny-dense's size as a Qwen2 (attention biases), for the byte-level BPE chat tokenizer; longer context for the
    # chat template's tool preamble. Its ids: 0 <|endoftext|> (pad), 1 <|im_start|>, 2 <|im_end|> (eos, end of turn).
    "tiny-chat": lambda vocab: Qwen2Config(vocab_size=vocab, max_position_embeddings=1024, eos_token_id=2, **_DENSE),
}

# Qwen2.5's template, less its default system prompt: ChatML turns, tools in the system turn, Hermes-style calls
# (<tool_call>{"name", "arguments"}</tool_call>) in assistant turns, tool results in a user turn. Tools are listed one
# per line, `name(parameters): description`, not as Qwen's JSON schemas: a schema and its instructions are ~110
# constant tokens in front of every prompt, and behind them a 0.9M-parameter policy needs 700-1,500 warm-start steps,
# depending on the seed, to learn to copy the question's numbers into its call (~250 steps with this line).
CHAT_TEMPLATE = (  # no "-" trimming; a newline right after a tag is written {{ '\n' }}, as trim_blocks drops it
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ '\n\n' }}"
    "{% endif %}# Tools\n{% for tool in tools %}{% set f = tool.function or tool %}"
    "{{ f.name }}({{ (f.parameters or {}).properties | default({}) | join(', ') }}): {{ f.description }}{{ '\n' }}"
    "{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls %}{% set call = call.function or call %}"
    "{% if not loop.first or message.content %}{{ '\n' }}{% endif %}<tool_call>\n{\"name\": \"{{ call.name }}\", "
    "\"arguments\": {% if call.arguments is string %}{{ call.arguments }}{% else %}{{ call.arguments | tojson }}"
    "{% endif %}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
    "{% endif %}{{ '\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character: built in code, so it is identical on every machine and needs no hub."""
    vocab = {tok: i for i, tok in enumerate(CHAR_TOKENS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")  # Oniguruma (?m) = dot-all
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def device_of(model_cfg) -> torch.device:
    """The device `model.device` names; auto = a GPU if torch sees one, else the CPU. A GPU without an index is the
    first visible one, or under torchrun the rank's own: cuda:LOCAL_RANK (as dist.init sets it)."""
    name = ("cuda" if torch.cuda.is_available() else "cpu") if model_cfg.device == "auto" else model_cfg.device
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"model.device is {name!r} but torch sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        local = int(os.environ["LOCAL_RANK"])
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"rank {local} of this node needs GPU {local} but torch sees "
                               f"{torch.cuda.device_count()}: give the run one GPU per rank (resources.gpus)")
        name = f"cuda:{local}"
    return torch.device(name)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (Qwen2's pre-tokenizer) with CHAT_TEMPLATE, trained on text of the built-in chat envs: the file
    beside this one, made by `python -m molt_envs.word_problems --tokenizer PATH` and checked against it by the
    tests, so the ids are the same on every machine; any text encodes (bytes)."""
    return PreTrainedTokenizerFast(tokenizer_file=str(CHAT_TOKENIZER),
                                   pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE)


def load_policy(model_cfg, seed: int):
    """(model, processor) in fp32 on `model.device`: a preset built from seed (on the CPU, so the same
    seed gives the same weights on every device), or `model_cfg.path` loaded offline. In eval mode unless
    `model.dropout`: the trainer's forward is then the sampler's (no dropout, no router jitter; gradients flow the
    same), so a checkpoint that ships dropout shows no false log-prob mismatch. The
    processor is the tokenizer itself for a text policy; a vision-language policy's processor wraps its tokenizer
    (`.tokenizer`) and also turns images into pixel values and image placeholder tokens."""
    device = device_of(model_cfg)  # before the weights: a wrong device fails fast
    if model_cfg.path:
        vision = hasattr(AutoConfig.from_pretrained(model_cfg.path, local_files_only=True), "vision_config")
        auto_model, auto_processor = (AutoModelForImageTextToText, AutoProcessor) if vision else (AutoModelForCausalLM, AutoTokenizer)
        processor = auto_processor.from_pretrained(model_cfg.path, local_files_only=True)
        model = auto_model.from_pretrained(model_cfg.path, local_files_only=True, dtype=torch.float32)
    else:
        processor = chat_tokenizer() if model_cfg.preset == "tiny-chat" else char_tokenizer()
        config = PRESETS[model_cfg.preset](len(processor))
        torch.manual_seed(seed)
        if vision := hasattr(config, "vision_config"):
            processor.add_tokens([IMAGE_TOKEN], special_tokens=True)  # id len(char vocab), as the preset expects
            size = config.vision_config.image_size
            processor = LlavaProcessor(
                image_processor=CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
                tokenizer=processor, patch_size=config.vision_config.patch_size, image_token=IMAGE_TOKEN,
                vision_feature_select_strategy=config.vision_feature_select_strategy, num_additional_image_tokens=1)
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(config, dtype=torch.float32)
        model.name_or_path = f"preset {model_cfg.preset} (seed {seed})"  # what a LoRA checkpoint names as its base
    if lora := model_cfg.lora:  # only the adapters train: all else, the vision tower included, is frozen unless targeted
        text = next(name for name, m in model.named_modules() if m is model.get_decoder())
        linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(text + ".")]
        torch.manual_seed(seed)  # the adapters' initialisation
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                           target_modules=lora.target_modules or linear, bias=lora.bias))
    tokenizer = getattr(processor, "tokenizer", processor)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    for router in routers(model):
        router.replay = None
        router.register_forward_hook(_route)
    model.to(device).train(model_cfg.dropout)
    moe, checkpointing = routers(model), model_cfg.gradient_checkpointing
    if checkpointing and moe:
        raise ValueError("model.gradient_checkpointing: not with an MoE policy (the backward's recompute would route "
                         "freely, not through the experts the sampler used)")
    if checkpointing:  # None: the memory plan decides at each update (loop.Training.update)
        set_checkpointing(model, True)
    return model, processor


def set_checkpointing(model, on: bool):
    """Turn transformers' activation checkpointing (non-reentrant) on or off; `model` may be wrapped (DDP, FSDP2)."""
    model = getattr(model, "module", model)
    if on == model.is_activation_checkpointing:
        return
    if on:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.activation_checkpointing_disable()
    for layer in model.modules():  # a layer checkpoints in training mode only: its own flag, not its submodules'
        if isinstance(layer, GradientCheckpointingLayer):  # (so dropout stays off); no-grad forwards run as is
            layer.training = on or model.training


def merged(weights: dict, lora) -> dict:
    """A LoRA policy's weights (peft's names) as its base model's own, each adapted layer's weight plus alpha/r x B A:
    what the sampler decodes with and plain transformers loads. Without LoRA (no adapter in them), the same tensors."""
    delta = {k.replace("lora_B.default", "base_layer"): lora.alpha / lora.r * (v @ weights[k.replace("_B.", "_A.")])
             for k, v in weights.items() if ".lora_B." in k}
    return {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v + delta[k] if k in delta else v
            for k, v in weights.items() if ".lora_" not in k}


# ---- MoE routing: what each router chose, and replaying a recorded choice ---------------------------------------------

def routers(model) -> list:
    """The top-k router of every MoE layer, in layer order; empty for a dense model. transformers' routers
    (Qwen3-MoE, Mixtral, ...) all return (router_logits, top-k weights, top-k expert ids) per token row."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _route(router, args, output):
    """Forward hook: keep this forward's own top-k (`natural`) and the top-k actually used (`selected`). The trainer
    sets `router.replay` (expert ids per token row, -1 = route freely) for its forward: there, recorded experts are
    used instead, with weights from this forward's router logits (kept for the balance loss), so the router keeps
    learning."""
    logits, weights, index = output
    router.natural = router.selected = index
    if router.replay is None:
        return None
    router.logits = logits
    index = torch.where(router.replay >= 0, router.replay, index)
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, index)
    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises; Qwen3-MoE says so in its config
        weights = weights / weights.sum(-1, keepdim=True)
    router.selected = index
    return logits, weights.to(logits.dtype), index


def routing_stats(layers: list, attention_mask, recorded, predicts_action) -> tuple[torch.Tensor, dict]:
    """After a training forward of an MoE policy whose routers are `layers`: the load-balancing aux loss and the
    routing metrics. `recorded` [B, T, L, k] holds the sampler's expert ids per input position (-1 where none),
    `predicts_action` [B, T] marks the positions whose logits give an action token."""
    real, n_experts = attention_mask.reshape(-1).bool(), layers[0].num_experts
    aux, metrics, entropies = 0.0, {}, []
    for l, router in enumerate(layers):
        # Switch-Transformer balance loss: n_experts * sum_e (share of top-k slots on e) * (mean router prob of e)
        share = torch.bincount(router.selected[real].flatten(), minlength=n_experts).float()
        share = share / share.sum().clamp(min=1)
        prob = torch.softmax(router.logits[real].float(), dim=-1).mean(0)
        aux = aux + n_experts * (share * prob).sum() / len(layers)
        entropies.append(float(torch.special.entr(share).sum()) / math.log(n_experts))
        metrics.update({f"expert_share_l{l}_e{e}": float(v) for e, v in enumerate(share)})
    # A token's routing differs when any layer's own top-k (as a set) differs from the one the sampler used.
    natural = torch.stack([r.natural.view(*recorded.shape[:2], -1) for r in layers], 2).sort(-1).values
    compared = predicts_action & (recorded[..., 0, 0] >= 0)
    differs = (natural != recorded.sort(-1).values).any(-1).any(-1)
    metrics.update(moe_aux_loss=aux.item(), moe_balance_entropy=sum(entropies) / len(entropies),
                   routing_mismatch=float(differs[compared].float().mean()) if compared.any() else 0.0)
    return aux, metrics
