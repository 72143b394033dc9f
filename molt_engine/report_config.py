"""The `report` section of the run config: which experiment trackers mirror the run (daemon/trackers.py does it)."""
from importlib.util import find_spec
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class WandbConfig(_Strict):
    project: str = Field("molt", description="W&B project")
    entity: str | None = Field(None, description="team or user; None = the API key's default")
    name: str | None = Field(None, description="run name; None = the run's name here")
    tags: list[str] = Field(default_factory=list)
    mode: Literal["online", "offline"] = Field("online", description="offline: files under dir, `wandb sync` later")
    dir: str | None = Field(None, description="where wandb writes its files; None = the run's directory")


class MlflowConfig(_Strict):
    tracking_uri: str | None = Field(None, description="http(s)://server, sqlite:///file.db, ...; None = "
                                     "$MLFLOW_TRACKING_URI, else MLflow's default")
    experiment: str = Field("molt", description="experiment name (created if missing)")
    run_name: str | None = Field(None, description="None = the run's name here")
    tags: dict[str, str] = Field(default_factory=dict)


class TensorboardConfig(_Strict):
    log_dir: str | None = Field(None, description="event files' directory; None = OUT/tensorboard")


class TrackioConfig(_Strict):
    project: str = Field("molt", description="Trackio project")
    name: str | None = Field(None, description="run name (Trackio resumes by name); None = the run's name here")
    space_id: str | None = Field(None, description="a Hugging Face Space to sync to; None = local only")
    group: str | None = None


class ReportConfig(_Strict):
    """Mirror the run to experiment trackers, off the training loop: a slow or failing tracker never slows or stops
    training; what a full queue drops or a tracker rejects is counted (metric report/dropped) and an event."""
    to: list[Literal["wandb", "mlflow", "tensorboard", "trackio"]] = Field(
        default_factory=list, description="trackers to mirror to, each needs its extra: pip install -e '.[wandb]'")
    log_model: bool = Field(False, description="also upload the best and final weights (W&B, MLflow), not just "
                            "their paths")
    samples_every: int = Field(10, ge=0, description="train steps between sample tables (evals: every one); 0 = none")
    queue: int = Field(10_000, gt=0, description="records a tracker may lag behind; beyond, new ones are dropped")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    trackio: TrackioConfig = Field(default_factory=TrackioConfig)

    @field_validator("to")
    @classmethod
    def _installed(cls, v, info):
        missing = [name for name in v if find_spec(name) is None]  # each tracker's module, and extra, is its name
        if missing and not (info.context or {}).get("files_elsewhere"):  # an external run's: installed where it trains
            raise ValueError("; ".join(f"{name} is not installed: pip install -e '.[{name}]'" for name in missing))
        if len(set(v)) < len(v):
            raise ValueError(f"a tracker is named twice: {v}")
        return v
