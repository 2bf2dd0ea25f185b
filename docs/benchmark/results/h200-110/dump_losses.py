import sys
from mlflow.tracking import MlflowClient
c = MlflowClient(sys.argv[1])
for e in c.search_experiments():
    for r in c.search_runs([e.experiment_id]):
        for m in ("train/loss", "train/grad_norm"):
            h = sorted(c.get_metric_history(r.info.run_id, m), key=lambda x: x.step)
            print(r.info.run_name, r.info.start_time, m, " ".join(f"{x.step}:{x.value:.4f}" for x in h))
