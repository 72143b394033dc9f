"""What a policy's or a distillation teacher's tokenizer files say, read without transformers: validating a config at
submit (the web process) loads neither torch nor transformers."""
import json
import string
from pathlib import Path

# The presets' character tokenizer (models.char_tokenizer): one token per printable character, after three specials
CHAR_TOKENS = ["<pad>", "<eos>", "<unk>", *(c for c in string.printable if c not in "\t\r\x0b\x0c")]
CHAT_TOKENIZER = Path(__file__).with_name("chat_tokenizer.json")  # tiny-chat's (models.chat_tokenizer)
IMAGE_TOKEN = "<image>"  # tiny-vlm's image placeholder, after the characters


def has_chat_template(model) -> bool:
    """Whether the policy (config.ModelConfig) has a chat template."""
    if not model.path:
        return model.preset == "tiny-chat"
    directory = Path(model.path)
    if (directory / "chat_template.jinja").exists() or (directory / "chat_template.json").exists():
        return True
    try:
        return bool(json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def policy_vocab(model) -> dict | None:
    """The policy's (config.ModelConfig) token ids, {token: id}; None where only transformers can read them."""
    if model.path:
        return file_vocab(Path(model.path) / "tokenizer.json")
    if model.preset == "tiny-chat":
        return file_vocab(CHAT_TOKENIZER)
    tokens = CHAR_TOKENS + [IMAGE_TOKEN] * (model.preset == "tiny-vlm")
    return {token: i for i, token in enumerate(tokens)}


def file_vocab(path) -> dict | None:
    """{token: id} of a fast tokenizer's tokenizer.json, added tokens included (transformers' get_vocab()); None
    without one (a slow tokenizer's files)."""
    try:
        tokenizer = json.loads(Path(path).read_text())
        ids = tokenizer["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(ids, list):  # Unigram: [piece, score] pairs in id order
        ids = {piece: i for i, (piece, _) in enumerate(ids)}
    return {**ids, **{added["content"]: added["id"] for added in tokenizer.get("added_tokens", [])}}


def teacher_mismatch(teacher: dict, policy: dict) -> str | None:
    """Why a teacher's log-probs, read at the policy's token ids, would be of other tokens; None when its tokenizer
    gives the policy's ids. Checked at submit where both files are readable here, else when the run starts."""
    if teacher == policy:
        return None
    token = next((t for t in policy if teacher.get(t) != policy[t]), None) or next(t for t in teacher if t not in policy)
    return (f"rewards.teacher: the teacher's tokenizer (vocab size {len(teacher)}) does not give the policy's token "
            f"ids (vocab size {len(policy)}; e.g. {token!r} is {teacher.get(token)} in the teacher's, "
            f"{policy.get(token)} in the policy's); distillation reads the teacher's log-probs at the policy's ids, "
            f"and mapping one tokenizer onto another is not supported: use a teacher with the policy's tokenizer")
