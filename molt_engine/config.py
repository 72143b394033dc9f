"""The run configuration: one validated pydantic model, so bad input fails before any work with the field named."""
import inspect
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .report_config import ReportConfig
from .tokenizer_files import file_vocab, has_chat_template, policy_vocab, teacher_mismatch

__all__ = ["RunConfig", "ValidationError", "config_errors"]

# Here rather than next to what they name, so that validating a config needs neither torch nor transformers.
PRESETS = ("tiny-dense", "tiny-moe", "tiny-vlm", "tiny-chat")     # built by models.PRESETS
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")      # advantage estimators that need group_size >= 2
# The validation context of a config whose files are on another machine (an external run's, on the dashboard): the
# schema only. Its model, datasets and user envs are checked by the training process, where they are.
ELSEWHERE = {"files_elsewhere": True}


class _Strict(BaseModel):
    # Unknown keys are typos the user wants to hear about, and `false` must not silently become 0.0.
    model_config = ConfigDict(extra="forbid", strict=True)


class LoraConfig(_Strict):
    """Train low-rank adapters (peft) instead of all weights; the sampler decodes with the merged weights."""
    r: int = Field(8, gt=0, description="rank of the adapters")
    alpha: float = Field(16.0, gt=0, description="scale: an adapter adds alpha/r x B A to its layer's weight")
    dropout: float = Field(0.0, ge=0, lt=1, description="only with model.dropout (then log-probs differ from the sampler's)")
    target_modules: list[str] | str | None = Field(None, description="names, or a regex; None = the LM's linear layers")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="biases trained too (and checkpointed)")
    save_merged: bool = Field(True, description="final/ and best/ also hold the merged model (plain transformers)")


class ModelConfig(_Strict):
    preset: str | None = Field("tiny-dense", description="built-in architecture, randomly initialised")
    path: str | None = Field(None, description="local Hugging Face causal-LM or vision-language (Llava) directory (overrides preset)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="auto | cpu | cuda | cuda:N; auto = the first visible GPU, else the CPU")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="sampler weights and trainer autocast; the trainer's weights and optimizer stay fp32")
    tool_parser: str = Field("hermes", description="how chat envs' tool calls are read from the policy's output: "
                             "hermes (Qwen, Hermes: <tool_call>{json}</tool_call>) or module:function of an env directory")
    dropout: bool = Field(False, description="keep the model's dropout (train mode) in the trainer's forward; off by "
                          "default, as in TRL: the sampler never has it, so with it the log-prob mismatch is noise")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters on the policy (None = all weights)")
    gradient_checkpointing: bool | None = Field(None, description="recompute each decoder layer's activations in the "
                                                "backward (transformers' own); None = the memory plan decides at each "
                                                "update: on when the activations would not fit (docs/trainer-memory.md)")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v):
        if v is not None and v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; known: {', '.join(sorted(PRESETS))}")
        return v

    @field_validator("tool_parser")
    @classmethod
    def _known_parser(cls, v, info):
        if v != "hermes" and info.context != ELSEWHERE:  # the built-in one (chat.PARSERS, which needs transformers)
            from .envs import resolve
            resolve(v, {"hermes": None}, "tool parser")
        return v

    @model_validator(mode="after")
    def _one_source(self):
        if self.preset is None and self.path is None:
            raise ValueError("set model.preset or model.path")
        return self


class LoopConfig(_Strict):
    steps: int = Field(400, gt=0, description="trainer steps (optimizer steps, policy versions) to train")
    groups_per_step: int = Field(16, gt=0, description="prompts per batch")
    group_size: int = Field(8, gt=0, description="episodes sampled per prompt")
    max_staleness: int = Field(0, ge=0, description="max policy versions between sampling and training; 0 = on-policy")
    workers: int | None = Field(None, gt=0, description="concurrent rollout groups; default groups_per_step x (max_staleness+1)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of training episodes (evals are greedy)")
    eval_every: int = Field(20, ge=0, description="steps between evals on held-out seeds; 0 = off")
    eval_episodes: int = Field(32, gt=0, description="greedy episodes on held-out seeds per eval")
    threads: int | None = Field(None, gt=0, description="update's torch threads (default: cores, one less off-policy)")
    sampler_process: bool = Field(False, description="decode in a child process (max_staleness > 0)")
    cuda_graphs: bool = Field(True, description="on CUDA, decode steps as CUDA graphs on static buffers (dense text "
                              "models); false: eager steps, as on the CPU")
    env_error_window: int = Field(32, gt=0, description="episodes; the run stops when more than half of them failed")
    kv_budget_gb: float | None = Field(None, gt=0, description="most KV-cache memory the sampler takes; requests "
                                       "beyond it queue; None = no limit")


class AlgoConfig(_Strict):
    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_baseline"] = Field("grpo", description="advantages")
    loss: Literal["ppo", "gspo"] = Field("ppo", description="ppo: a ratio per token; gspo: per sequence")
    clip_low: float = Field(0.2, ge=0, description="gspo: 3e-4")
    clip_high: float = Field(0.28, ge=0, description="gspo: 4e-4")
    is_level: Literal["off", "token", "seq", "geo"] = Field("token", description="IS weights per token, sequence or geo mean")
    is_mode: Literal["mask", "clip", "trunc"] = Field("trunc", description="trunc: cap at is_high; clip: clamp; mask: zero")
    is_low: float = Field(0.0, ge=0, description="lower end of the IS ratio's band (clip, mask)")
    is_high: float = Field(2.0, gt=0, description="upper end of the IS ratio's band")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the frozen initial policy; 0 = no reference")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Schulman's estimator of the KL term")
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate of the RL updates; model.path: 1e-6")  # 5e-4: max_digit seed 1 stuck near 0.8
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients clipped to this norm")
    minibatches: int = Field(1, gt=0, description="optimizer steps per trainer step, each on a slice of the batch's "
                             "groups; with more than one step per trainer step the PPO/GSPO clip acts")
    epochs: int = Field(1, gt=0, description="passes over the batch per trainer step (each pass is minibatches steps)")
    micro_batch_size: int | None = Field(None, gt=0, description="episodes per forward/backward, gradients "
                                         "accumulated over a minibatch; None = the whole minibatch at once")
    filter_zero_variance: bool = Field(False, description="drop groups whose rewards are all equal (DAPO dynamic "
                                       "sampling): at most groups_per_step a step, counted in groups_filtered")
    # MoE policies only (ignored for dense ones)
    routing_replay: bool = Field(True, description="MoE: the training forward uses the experts the sampler used")
    router_aux_coef: float | None = Field(None, ge=0, description="MoE: weight of the load-balancing loss; "
                                                                   "None = the model config's router_aux_loss_coef")
    router_freeze: bool = Field(False, description="MoE: router weights get no update")

    @model_validator(mode="after")
    def _band(self):
        if self.is_low > self.is_high:
            raise ValueError(f"is_low ({self.is_low}) must not exceed is_high ({self.is_high})")
        return self


class WarmStartConfig(_Strict):
    steps: int = Field(70, ge=0, description="supervised steps on env demonstrations before RL; 0 = none; model.path: 0")
    batch_size: int = Field(32, gt=0, description="demonstrations per supervised step")
    lr: float = Field(3e-3, gt=0, description="model.path: 1e-5")


class CheckpointConfig(_Strict):
    every: int = Field(50, ge=0, description="steps between checkpoints; 0 = only on stop")
    keep: int = Field(3, gt=0, description="newest checkpoints kept on disk (the policy of the best eval is kept in OUT/best)")


class BreakerConfig(_Strict):
    factor: float = Field(25.0, gt=1, description="trip when the grad norm exceeds factor x the rolling median")
    window: int = Field(50, gt=0, description="healthy steps in the rolling median")
    min_history: int = Field(10, gt=0, description="healthy steps needed before the median rule applies")
    floor: float = Field(10.0, ge=0, description="never trip below this norm: late in training, when most groups "
                         "are solved, the median gets tiny and healthy steps vary 20x and more around it")
    abs_max: float | None = Field(None, gt=0, description="trip above this grad norm regardless of history")
    cooldown: int = Field(3, ge=0, description="healthy steps of strict on-policy admission after a trip")
    max_trips: int = Field(3, gt=0, description="trips within trip_window that trigger a rollback")
    trip_window: int = Field(50, gt=0, description="steps over which max_trips counts")
    max_rollbacks: int = Field(1, ge=0, description="rollbacks before a run that keeps tripping ends as tripped")


class AlertsConfig(_Strict):
    window: int = Field(10, gt=0, description="steps over which the stale-dropped share is measured")
    stale_share: float = Field(0.2, gt=0, le=1, description="alert when this share of samples is dropped as stale")
    # Not named after its metric, as the other thresholds are: staleness_max is the metric and loop.max_staleness the
    # admission bound. The old key is still read.
    staleness_reaches: int | None = Field(
        None, ge=0, validation_alias=AliasChoices("staleness_reaches", "staleness_max"),
        description="alert when a trained token is this many versions old (the metric staleness_max reaches it); "
                    "None = never. Formerly alerts.staleness_max")
    mismatch_kl: float = Field(0.05, gt=0, description="alert when the behaviour-vs-recomputed KL exceeds this")
    no_signal_steps: int | None = Field(10, gt=0, description="alert when this many steps in a row had no learning "
                                        "signal (grad norm 0, or every reward equal); None = never")


class RecordConfig(_Strict):
    """The samples recorded for the Samples view: episodes with their per-token numbers."""
    samples_per_step: int = Field(2, ge=0, description="groups of each trained batch recorded as samples (those "
                                  "with a learning signal first); 0 = none")
    eval_samples: int = Field(4, ge=0, description="episodes of each eval recorded (the first held-out prompts, "
                              "the same at every eval); 0 = none")
    keep_steps: int | None = Field(None, gt=0, description="keep only the samples of the newest this many steps; "
                                   "None = all")


class DrillsConfig(_Strict):
    """Injected faults, so that users and tests can prove the alarms and the supervisor work."""
    spike_at: list[int] = Field(default_factory=list, description="steps whose gradient gets a spike of spike_norm")
    spike_norm: float = Field(1e3, gt=0, description="the injected spike's gradient norm")
    nan_at: list[int] = Field(default_factory=list, description="steps whose loss is NaN")
    crash_at: list[int] = Field(default_factory=list, description="steps at which the process dies (os._exit)")
    crash_repeat: bool = Field(False, description="crash at those steps on every attempt, not just the first")
    hang_at: list[int] = Field(default_factory=list, description="steps at which the event loop blocks (no heartbeat)")
    hang_seconds: float = Field(3600.0, gt=0, description="how long a hang_at hang blocks")
    env_error_rate: float = Field(0.0, ge=0, le=1, description="share of env steps that raise")
    oom_at: list[int] = Field(default_factory=list, description="steps whose update raises torch.OutOfMemoryError once")
    oom_rank: int | None = Field(None, ge=0, description="more than one process: the rank that runs out (None = all)")
    oom_in: Literal["update", "backward"] = Field("update", description="where oom_at runs out: before the update "
                                                  "(every rank retries at half the micro-batch), or in oom_rank's "
                                                  "first backward while micro-batches are the config's (the attempt "
                                                  "ends; the next starts at half)")
    full_disk_at: list[int] = Field(default_factory=list, description="steps whose checkpoint write fails with "
                                    "ENOSPC halfway (once each, remembered across restarts on disk)")
    db_full_disk_at: list[int] = Field(default_factory=list, description="steps whose first database write of "
                                       "metrics fails with ENOSPC (a daemon run's sink keeps them and retries)")


class ResourcesConfig(_Strict):
    gpus: int | None = Field(None, ge=0, description="GPUs the daemon gives the run's worker; None = dist.nproc "
                             "where the daemon has GPUs (one per rank), else 0")


class DistConfig(_Strict):
    """More than one process: torchrun ranks, each sampling its share of the prompts; the update is data-parallel."""
    nproc: int = Field(1, gt=0, description="processes (torchrun ranks) per node; loop.groups_per_step is the "
                       "batch of all ranks together")
    nnodes: int = Field(1, gt=0, description="nodes, each with nproc ranks: placed by a daemon on a Ray cluster (--ray)")
    strategy: Literal["ddp", "fsdp2"] = Field("ddp", description="ddp: every rank holds the whole model; fsdp2: "
                                              "parameters, gradients and optimizer state sharded over the ranks")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl with GPUs, else gloo")
    timeout_s: float = Field(600.0, gt=0, description="seconds a rank waits in a collective for the others before "
                             "the attempt ends (the daemon restarts it from the checkpoint)")


class SuiteConfig(_Strict):
    """One more env (or dataset) evaluated beside the training env's eval, its metrics prefixed `NAME/`."""
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,40}$", description="its metrics' prefix: NAME/eval_reward, ...")
    env: str = Field(description="the env (or dataset env) evaluated, by its registered name")
    env_args: dict = Field(default_factory=dict, description="keyword arguments of the env's constructor")
    episodes: int | None = Field(None, gt=0, description="greedy episodes per eval; None = loop.eval_episodes")

    @field_validator("env")
    @classmethod
    def _known_env(cls, v, info):
        from .envs import ENVS
        from .serving.agents import Agent
        if info.context != ELSEWHERE and issubclass(ENVS[RunConfig._known_env(v, info)], Agent):
            raise ValueError(f"env {v!r} is an agent, which needs the run's served endpoint: not in eval suites")
        return v


class EvalConfig(_Strict):
    """Evals beside the training env's (loop.eval_every, loop.eval_episodes) and which metric keeps OUT/best."""
    suites: list[SuiteConfig] = Field(default_factory=list, description="envs or datasets also evaluated at every eval")
    best: str = Field("eval_reward", description="eval metric whose best value keeps OUT/best; a suite's: NAME/eval_...")

    @model_validator(mode="after")
    def _names(self):
        names = [s.name for s in self.suites]
        if len(set(names)) < len(names):
            raise ValueError(f"suite names must be unique, got {names}")
        suite, _, metric = self.best.rpartition("/")
        if not metric.startswith("eval_") or suite and suite not in names:
            raise ValueError(f"best {self.best!r} is not an eval metric of the training env (eval_...) or of "
                             f"a suite (NAME/eval_..., suites: {', '.join(names) or 'none'})")
        return self


class JudgeConfig(_Strict):
    """An LLM judge behind an OpenAI-compatible endpoint, or a local model (molt_rewards/judges.py): a rubric, one
    call per episode (pointwise) or per group (group, RULER-like: the group's answers scored relative to each other)."""
    base_url: str | None = Field(None, description="the endpoint, e.g. http://127.0.0.1:8000/v1; None = model is a "
                                 "local directory")
    model: str = Field(description="the judge model's name at the endpoint; without base_url, a local Hugging Face "
                       "causal-LM directory with a chat template, run on the term's device by the engine's sampler")
    max_tokens: int = Field(64, gt=0, description="local judge: tokens per reply at most (greedy)")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="environment variable "
                                    "that holds the key (the key itself never goes in a config); None = no key")
    mode: Literal["pointwise", "group"] = Field("pointwise", description="pointwise: each answer scored 0-1 alone; "
                                                "group: a group's answers in one call, scored relative to each other")
    rubric: str = Field("Score how correct and helpful the answer is to the question.", description="the judge's "
                        "instructions (its system message); the reply format it must use is added after it")
    concurrency: int | None = Field(None, gt=0, description="calls in flight at most, over the whole run; None = "
                                    "no bound below the loop's own ((max_staleness + 1) x groups_per_step groups)")
    timeout_s: float = Field(30.0, gt=0, description="seconds per call before it counts as a timeout")
    retries: int = Field(1, ge=0, description="calls again after a failed, timed-out or unreadable one")
    on_error: Literal["zero", "drop"] = Field("zero", description="when every try failed: the term scores 0, or the "
                                              "episode is dropped (not trained); either way counted")

    @model_validator(mode="after")
    def _local(self, info):
        if self.base_url is None and info.context != ELSEWHERE and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"judge: without base_url, model {self.model!r} must be a local Hugging Face model "
                             f"directory (no config.json)")
        return self


class RewardTerm(_Strict):
    """One more reward term: a function, a reward model or a judge (exactly one), weighted into the episode's reward."""
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,40}$", description="recorded as the metric reward/NAME (unweighted)")
    weight: float = Field(1.0, description="the episode's reward is rewards.env_weight x env reward + sum of weight x term")
    function: str | None = Field(None, description="module:function of an env directory, sync or async def: "
                                 "f(prompt=..., completion=..., env_reward=...) -> float")
    model: str | None = Field(None, description="local Hugging Face AutoModelForSequenceClassification directory: its "
                              "first logit for the episode's text (its chat template where it has one)")
    judge: JudgeConfig | None = Field(None, description="an LLM judge's score, 0-1")
    device: str = Field("trainer", pattern=r"^(trainer|cpu|cuda(:\d+)?)$", description="model, local judge: where "
                        "it runs; trainer = the trainer's device")
    normalize: Literal["none", "group"] = Field("none", description="group: the term's values standardised within "
                                                "each group (mean 0, std 1) before weighting")

    @model_validator(mode="after")
    def _one_kind(self, info):
        kinds = [k for k in ("function", "model", "judge") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"reward term {self.name!r}: set exactly one of function, model, judge (got "
                             f"{', '.join(kinds) or 'none'})")
        if self.function and info.context != ELSEWHERE:
            from .envs import resolve
            resolve(self.function, {}, "reward function")
        if self.model and info.context != ELSEWHERE and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"reward term {self.name!r}: model {self.model!r} is not a Hugging Face model directory "
                             f"(no config.json)")
        return self


class TeacherConfig(_Strict):
    """On-policy distillation: a teacher scores every token the policy sampled; its per-token reverse KL (teacher
    log-prob - the policy's behaviour log-prob) x coef is added to each token's advantage."""
    path: str = Field(description="local Hugging Face causal-LM directory with the policy's tokenizer (the "
                      "same token ids; another tokenizer is refused)")
    coef: float = Field(1.0, gt=0, description="weight of the per-token reverse KL in the advantage")
    device: str = Field("trainer", pattern=r"^(trainer|cpu|cuda(:\d+)?)$", description="trainer = the trainer's device")

    @field_validator("path")
    @classmethod
    def _a_model(cls, v, info):
        if info.context != ELSEWHERE and not (Path(v) / "config.json").is_file():
            raise ValueError(f"{v!r} is not a Hugging Face model directory (no config.json)")
        return v


class RewardsConfig(_Strict):
    """The episode's reward: the env's, weighted, plus any number of weighted terms (TRL's reward_funcs and
    reward_weights), scored in the loop's reward stage (molt_rewards). Evals report the env's reward alone."""
    env_weight: float = Field(1.0, description="weight of the env's own reward (0: the terms alone)")
    terms: list[RewardTerm] = Field(default_factory=list, description="extra reward terms, each recorded as reward/NAME")
    teacher: TeacherConfig | None = Field(None, description="on-policy distillation from a teacher (None = none)")

    @model_validator(mode="after")
    def _names(self):
        names = [t.name for t in self.terms]
        if len(set(names)) < len(names) or "env" in names:
            raise ValueError(f"reward term names must be unique and not 'env', got {names}")
        return self


class RunConfig(_Strict):
    env: str = Field(description="the env, agent or dataset env to train on, by its registered name")
    env_args: dict = Field(default_factory=dict, description="keyword arguments of the env's constructor")
    model: ModelConfig = Field(default_factory=ModelConfig)
    seed: int = Field(0, ge=0, lt=2**30, description="seeds the initial weights and the episodes")
    loop: LoopConfig = Field(default_factory=LoopConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    record: RecordConfig = Field(default_factory=RecordConfig)
    drills: DrillsConfig = Field(default_factory=DrillsConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)

    @field_validator("env")
    @classmethod
    def _known_env(cls, v, info):
        from .envs import ENVS, LOAD_ERRORS, load_user_envs
        if v in ENVS or info.context == ELSEWHERE:
            return v
        load_user_envs()  # a user's env directory ($MOLT_ENVS), tried again: a file may have been fixed
        if v not in ENVS:
            failed = f"; env files that failed to load: {'; '.join(LOAD_ERRORS.values())}" if LOAD_ERRORS else ""
            raise ValueError(f"unknown env {v!r}; known: {', '.join(sorted(ENVS))}{failed}")
        return v

    @model_validator(mode="after")
    def _run_defaults(self):
        """Defaults that depend on the run (docs/models.md), set only where the config leaves the field unset."""
        defaults = []
        if self.model.path:  # a trained checkpoint: the presets' rates (a 1M-parameter policy from scratch) wreck it
            defaults += [(self.algo, "lr", 1e-6), (self.warm_start, "steps", 0), (self.warm_start, "lr", 1e-5)]
        if self.algo.loss == "gspo":  # a sequence's ratio (its tokens' geometric mean) moves far less than a token's
            defaults += [(self.algo, "clip_low", 3e-4), (self.algo, "clip_high", 4e-4)]  # the GSPO paper's band
        for part, name, value in defaults:
            if name not in part.model_fields_set:
                setattr(part, name, value)
        return self

    @model_validator(mode="after")
    def _consistent(self, info):
        if self.loop.group_size < 2 and self.algo.estimator in GROUP_ESTIMATORS:
            raise ValueError(f"loop.group_size must be >= 2 with the group estimator {self.algo.estimator!r}")
        if self.algo.minibatches > self.loop.groups_per_step:
            raise ValueError(f"algo.minibatches ({self.algo.minibatches}) must not exceed loop.groups_per_step "
                             f"({self.loop.groups_per_step}): a minibatch holds whole groups")
        share = self.loop.groups_per_step // (ranks := self.dist.nproc * self.dist.nnodes)  # each rank's groups
        if self.loop.groups_per_step % ranks or self.algo.minibatches > share:
            raise ValueError(f"loop.groups_per_step ({self.loop.groups_per_step}) must split evenly over the {ranks} "
                             f"ranks (dist.nproc x dist.nnodes), into at least algo.minibatches "
                             f"({self.algo.minibatches}) groups each")
        from .envs import ENVS, make_env, where
        if info.context == ELSEWHERE:
            return self
        if ENVS[self.env].chat and not has_chat_template(self.model):
            raise ValueError(f"env {self.env!r} speaks chat messages, but the policy's tokenizer has no chat template "
                             f"(use model.preset 'tiny-chat', or a model.path whose tokenizer has one)")
        try:
            if self.env == "dataset":  # its env loads whole files: a submitted config is checked on their first rows
                from .data import check_submitted
                check_submitted(**self.env_args)
            else:
                make_env(self.env, self.env_args)
        except (TypeError, ValueError) as e:
            raise ValueError(f"env_args: {e}") from None
        except Exception as e:  # a user's constructor: say where it failed
            file = inspect.getsourcefile(ENVS[self.env]) or "?"
            raise ValueError(f"env {self.env!r} failed to start: {where(e, file)}") from None
        return self

    @model_validator(mode="after")
    def _teacher_tokenizer(self, info):
        teacher = self.rewards.teacher
        if teacher and info.context != ELSEWHERE:  # where a tokenizer's files need transformers: at the run's start
            ids, policy = file_vocab(Path(teacher.path) / "tokenizer.json"), policy_vocab(self.model)
            if ids and policy and (why := teacher_mismatch(ids, policy)):
                raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _suites_start(self, info):
        for i, suite in enumerate(self.eval.suites):  # the training env's checks, on each suite's env
            try:
                self.model_copy(update={"env": suite.env, "env_args": suite.env_args})._consistent(info)
            except ValueError as e:
                raise ValueError(f"eval.suites.{i} ({suite.name}): {e}") from None
        return self


def untrained_lora(cfg: RunConfig) -> str | None:
    """Why a run a user queues or starts could not learn: LoRA freezes the base, and every preset is randomly
    initialised. The one rule of POST /api/v1/runs, the launch form, sweeps and `molt train`; the engine's train()
    still trains such a run (the tests of LoRA's mechanics do)."""
    if cfg.model.lora and not cfg.model.path:
        return (f"model.lora: LoRA trains adapters on a frozen base model, and preset {cfg.model.preset!r} is randomly "
                f"initialised (untrained), so the run could not learn; give model.path a trained model, or leave out "
                f"model.lora to train every weight")
    return None


def config_errors(e: ValidationError) -> list[str]:
    """One readable line per problem, each naming the field (`loop.steps: ...`)."""
    return [f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()]
