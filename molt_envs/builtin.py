"""The built-in envs: largest digit (text), a calculator tool in text and in chat, guess-the-number over several
turns, and shapes in an image (vision). Written against the engine's Env contract as a user's envs are."""
import ast
import asyncio
import operator
import random
import re
import warnings

from PIL import Image, ImageDraw

from molt_engine.envs import Env, Observation, Result, register


def _parse_int(text: str) -> int | None:
    text = text.strip()
    return int(text) if re.fullmatch(r"-?\d{1,9}", text) else None


def _final(correct: bool) -> Result:
    return Result(reward=1.0 if correct else 0.0, terminated=True)


@register
class MaxDigit(Env):
    """Single turn: answer the largest of a few digits. Prompt "7 2 9 4=", answer "9"."""

    name = "max_digit"
    max_tokens = 4

    @staticmethod
    def _digits(seed: int) -> list[int]:
        # The largest digit is drawn uniformly: with i.i.d. digits it is 8 or 9 most of the time, "always say 9"
        # scores ~0.5, and the rare small maxima never get learned.
        rng = random.Random(seed)
        top = rng.randint(0, 9)
        digits = [top] + [rng.randint(0, top) for _ in range(rng.randint(2, 4))]
        rng.shuffle(digits)
        return digits

    async def reset(self, seed: int) -> Observation:
        digits = self._digits(seed)
        self._answer = max(digits)
        return Observation(" ".join(map(str, digits)) + "=")

    async def step(self, action: str) -> Result:
        return _final(action.strip() == str(self._answer))

    def demonstration(self, seed: int) -> list[str]:
        return [str(max(self._digits(seed)))]


# The only tool syntax accepted; operands are plain non-negative integers, never evaluated as code.
_TOOL_CALL = re.compile(r"calc (\d{1,6})([-+*])(\d{1,6})")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@register
class Calculator(Env):
    """Tool use: "Q 347*29\\n" -> action "calc 347*29" -> "=10063\\n" -> action "10063"."""

    name = "calculator"
    max_turns = 3
    max_tokens = 12

    def __init__(self, *, tool_latency_ms: float = 0.0, tail_prob: float = 0.0, tail_ms: float = 0.0,
                 max_operand: int = 99, max_second: int = 99, **unknown):
        super().__init__(**unknown)
        if tool_latency_ms < 0 or tail_ms < 0 or not 0.0 <= tail_prob <= 1.0:
            raise ValueError("calculator: latencies must be >= 0 and tail_prob in [0, 1]")
        if not 10 <= max_operand <= 999_999 or not 2 <= max_second <= 999_999:
            raise ValueError("calculator: max_operand must be in [10, 999999] and max_second in [2, 999999]")
        self.tool_latency_ms, self.tail_prob, self.tail_ms = tool_latency_ms, tail_prob, tail_ms
        self.max_operand, self.max_second = max_operand, max_second

    async def reset(self, seed: int) -> Observation:
        # The same generator then draws the latency tails, so slow calls are reproducible per seed.
        self._rng = random.Random(seed)
        a, op, b, self._answer = calculator_question(self._rng, self.max_operand, self.max_second)
        return Observation(f"Q {a}{op}{b}\n")

    async def step(self, action: str) -> Result:
        action = action.strip()
        if not action.startswith("calc"):
            return _final(_parse_int(action) == self._answer)
        latency_ms = self.tail_ms if self._rng.random() < self.tail_prob else self.tool_latency_ms
        if latency_ms > 0:
            await asyncio.sleep(latency_ms / 1000)
        call = _TOOL_CALL.fullmatch(action)
        if call is None:
            return Result(reward=0.0, observation="err\n", info={"tool_call": True, "tool_error": True})
        a, op, b = call.groups()
        return Result(reward=0.0, observation=f"={_OPS[op](int(a), int(b))}\n", info={"tool_call": True})

    def demonstration(self, seed: int) -> list[str]:
        a, op, b, value = calculator_question(random.Random(seed), self.max_operand, self.max_second)
        return [f"calc {a}{op}{b}", str(value)]


def calculator_question(rng: random.Random, max_operand: int = 99, max_second: int = 99) -> tuple[int, str, int, int]:
    """a, op, b and the value. 2-digit operands by default: a product a tiny model cannot do in its head, short enough
    to learn to copy."""
    a, op, b = rng.randint(10, max_operand), rng.choice("+-*"), rng.randint(2, max_second)
    return a, op, b, _OPS[op](a, b)


_AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(node) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
        return _AST_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError("only integers joined by +, - and * are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expression: integers joined by +, - or *, e.g. "12*7"
    """
    if len(expression) > 64:  # bounds the size of a product
        raise ValueError("expression longer than 64 characters")
    try:
        with warnings.catch_warnings():  # the policy's garbage ("2x") is an error result, not a warning on stderr
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return str(_evaluate(tree.body))


@register
class ChatCalculator(Env):
    """Chat-native tool use: "What is 47*8?" -> a native `calculator` tool call -> its result -> the answer "376".

    `mental_share` of the demonstrations answer at once, as someone who multiplies in their head: right, but beyond
    what a tiny policy can imitate. The warm start then teaches both ways, and RL learns that the tool call pays."""

    name = "chat_calculator"
    chat = True
    tools = (calculator,)
    max_turns = 3
    max_tokens = 32

    def __init__(self, *, mental_share: float = 0.6, **unknown):
        super().__init__(**unknown)
        if not 0.0 <= mental_share <= 1.0:
            raise ValueError(f"{self.name}: mental_share must be in [0, 1], got {mental_share}")
        self.mental_share = mental_share

    async def reset(self, seed: int) -> Observation:
        a, op, b, self._answer = calculator_question(random.Random(seed))
        return Observation(messages=[{"role": "user", "content": f"What is {a}{op}{b}?"}])

    async def step(self, action: str) -> Result:
        return _final(_parse_int(action) == self._answer)

    def demonstration(self, seed: int) -> list[dict]:
        rng = random.Random(seed)
        a, op, b, value = calculator_question(rng)
        if rng.random() < self.mental_share:
            return [{"role": "assistant", "content": str(value)}]
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "assistant", "content": str(value)}]


@register
class GuessNumber(Env):
    """Feedback: "guess 1-16\\n" -> "8" -> "higher\\n" -> "12" -> ... until the hidden number is hit."""

    name = "guess_number"
    max_tokens = 4

    def __init__(self, *, high: int = 16, turns: int = 5, **unknown):
        super().__init__(**unknown)
        if high < 1 or turns < 1:
            raise ValueError("guess_number: high and turns must be >= 1")
        self.high = high
        self.max_turns = turns  # instance attribute: the engine reads max_turns from the env it made

    def _secret(self, seed: int) -> int:
        return random.Random(seed).randint(1, self.high)

    async def reset(self, seed: int) -> Observation:
        self._secret_number = self._secret(seed)
        return Observation(f"guess 1-{self.high}\n")

    async def step(self, action: str) -> Result:
        guess = _parse_int(action)
        hint = "?\n" if guess is None else "higher\n" if guess < self._secret_number else "lower\n"
        return _final(True) if guess == self._secret_number else Result(reward=0.0, observation=hint)

    def demonstration(self, seed: int) -> list[str]:
        # Binary search: ceil(log2(high + 1)) guesses at most, 5 for the default 1-16.
        secret, low, high, guesses = self._secret(seed), 1, self.high, []
        while True:
            guess = (low + high) // 2
            guesses.append(str(guess))
            if guess == secret:
                return guesses
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (40, 70, 240), "yellow": (230, 220, 30),
           "purple": (160, 40, 200), "white": (240, 240, 240)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = ("color", "shape", "count")


@register
class Shapes(Env):
    """Vision: a 32x32 image of 1-4 identical shapes (one per quadrant) and a question about their colour, shape or
    count: "<image>shape?\\n" -> "circle". With turns > 1, the feedback brings a new image and question; each turn
    is worth 1/turns. Chance, answering uniformly among the valid answers: (1/6 + 1/3 + 1/4) / 3 = 0.25."""

    name = "shapes"
    max_tokens = 10  # "triangle" + eos

    def __init__(self, *, turns: int = 1, **unknown):
        super().__init__(**unknown)
        if not 1 <= turns <= 4:
            raise ValueError("shapes: turns must be in [1, 4]")
        self.max_turns = turns

    def _scenes(self, seed: int) -> list[tuple[str, str, list[tuple[int, int]], str]]:
        """Per turn: colour, shape, the top-left corners of the drawn shapes, and the question."""
        rng = random.Random(seed)
        scenes = []
        for _ in range(self.max_turns):
            colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
            cells = rng.sample([(0, 0), (16, 0), (0, 16), (16, 16)], rng.randint(1, 4))
            corners = [(x + rng.randint(1, 3), y + rng.randint(1, 3)) for x, y in cells]
            scenes.append((colour, shape, corners, rng.choice(QUESTIONS)))
        return scenes

    @staticmethod
    def render(colour: str, shape: str, corners: list[tuple[int, int]]) -> Image.Image:
        image = Image.new("RGB", (32, 32))
        draw = ImageDraw.Draw(image)
        for x, y in corners:  # each shape fits a 12x12 box inside its 16x16 quadrant
            if shape == "triangle":
                draw.polygon([(x + 5.5, y), (x, y + 11), (x + 11, y + 11)], fill=COLOURS[colour])
            else:
                (draw.ellipse if shape == "circle" else draw.rectangle)((x, y, x + 11, y + 11), fill=COLOURS[colour])
        return image

    @staticmethod
    def _answer(scene) -> str:
        colour, shape, corners, question = scene
        return {"color": colour, "shape": shape, "count": str(len(corners))}[question]

    def _observe(self, scene) -> tuple[str, list]:
        return f"<image>{scene[3]}?\n", [self.render(*scene[:3])]

    async def reset(self, seed: int) -> Observation:
        self._episode_scenes, self._turn = self._scenes(seed), 0
        return Observation(*self._observe(self._episode_scenes[0]))

    async def step(self, action: str) -> Result:
        correct = action.strip().lower() == self._answer(self._episode_scenes[self._turn])
        self._turn += 1
        reward = float(correct) / self.max_turns
        if self._turn == self.max_turns:
            return Result(reward=reward, terminated=True)
        text, images = self._observe(self._episode_scenes[self._turn])
        return Result(reward=reward, observation=("yes\n" if correct else "no\n") + text, images=images)

    def demonstration(self, seed: int) -> list[str]:
        return [self._answer(scene) for scene in self._scenes(seed)]
