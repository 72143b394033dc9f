"""`GET /metrics` for Prometheus: the daemon, the runs and the running runs' progress, read from the records at each
scrape and written in the text format by prometheus-client."""
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .rest import authenticated

router = APIRouter()
RUN_LABELS = ["run_id", "name"]
PER_RUN = [  # (metric, the run's latest value of, help)
    ("molt_run_reward", "reward_mean", "the run's latest mean reward"),
    ("molt_run_samples_per_second", "samples_per_s", "the run's latest training throughput"),
    ("molt_run_staleness_mean", "staleness_mean", "mean policy versions its latest batch lagged"),
    ("molt_run_staleness_max", "staleness_max", "most policy versions a sample of its latest batch lagged"),
]


class RecordsCollector:
    """A prometheus-client collector over the records: every scrape reads them afresh (no state in this process,
    so `molt web` beside `molt daemon` reports the same as `molt serve`)."""

    def __init__(self, records):
        self.records = records

    def collect(self):
        daemon = self.records.daemon_status()
        seen = self.records.overview()
        yield GaugeMetricFamily("molt_daemon_up", "1 while a daemon owns the data directory and beats, else 0",
                                value=1 if daemon["alive"] else 0)
        restarts = CounterMetricFamily("molt_daemon_restarts", "times the daemon went down and was restarted, "
                                                               "by cause", labels=["cause"])
        for cause, n in seen["daemon_restarts"].items():
            restarts.add_metric([cause], n)
        yield restarts
        runs = GaugeMetricFamily("molt_runs", "runs by status", labels=["status"])
        for status, n in seen["runs_by_status"].items():
            runs.add_metric([status], n)
        yield runs
        yield GaugeMetricFamily("molt_queue_length", "runs queued, waiting for a free slot",
                                value=seen["runs_by_status"]["queued"])
        workers = CounterMetricFamily("molt_worker_restarts", "worker attempts that ended other than cleanly, by "
                                                              "cause (each restarted unless its budget ran out)",
                                      labels=["cause"])
        for cause, n in seen["worker_restarts"].items():
            workers.add_metric([cause], n)
        yield workers

        step = GaugeMetricFamily("molt_run_step", "trainer steps done by the running run", labels=RUN_LABELS)
        trips = CounterMetricFamily("molt_run_breaker_trips", "circuit-breaker trips of the running run",
                                    labels=RUN_LABELS)
        latest = {name: GaugeMetricFamily(metric, text, labels=RUN_LABELS) for metric, name, text in PER_RUN}
        for run in seen["running"]:
            labels = [str(run["id"]), run["name"]]
            step.add_metric(labels, run["step"])
            trips.add_metric(labels, run["breaker_trips"])
            for name, value in run["latest"].items():
                latest[name].add_metric(labels, value)
        yield step
        yield trips
        yield from latest.values()


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request):
    """Token-protected like the API, unless the server was started with --metrics-public."""
    if not request.app.state.metrics_public:
        authenticated(request)
    return Response(generate_latest(request.app.state.prometheus), media_type=CONTENT_TYPE_LATEST)
