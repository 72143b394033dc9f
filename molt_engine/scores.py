"""An evaluation's scores from its episodes' rewards and successes: pass@k by the unbiased estimator, and the means
of the metrics envs report. Pure functions: the run's evals and the daemon's evaluation jobs both score with them."""
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of a prompt of which c passed: 1 - C(n-c, k) / C(n, k), the
    chance that k of the n drawn without replacement hold at least one pass."""
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def scores(prompts: list[list[tuple[float, bool]]], k: int) -> dict:
    """pass@1, pass@k and avg@k (the mean reward of a prompt's samples), each averaged over the prompts, the mean
    reward over all episodes, and its standard error from each prompt's (reward, success) samples. The error is
    clustered by prompt: a prompt's k samples share its difficulty, so they are not k independent draws; with k
    samples each, the mean reward is the mean of the prompts' means, whose spread gives the error."""
    n_prompts, episodes = len(prompts), [e for p in prompts for e in p]
    means = [sum(r for r, _ in p) / len(p) for p in prompts]
    spread = sum((m - sum(means) / n_prompts) ** 2 for m in means) / max(n_prompts - 1, 1)
    return {"mean_reward": sum(r for r, _ in episodes) / len(episodes), "mean_reward_se": (spread / n_prompts) ** 0.5,
            "pass@1": sum(pass_at_k(len(p), sum(s for _, s in p), 1) for p in prompts) / n_prompts,
            f"pass@{k}": sum(pass_at_k(len(p), sum(s for _, s in p), k) for p in prompts) / n_prompts,
            f"avg@{k}": sum(means) / n_prompts}


def metric_means(reported: list[dict]) -> dict:
    """Each metric envs report in Result.info["metrics"] (e.g. accuracy_strict), averaged over the episodes that
    report it."""
    names = sorted({name for m in reported for name in m})
    return {name: sum(m[name] for m in reported if name in m) / sum(name in m for m in reported) for name in names}
