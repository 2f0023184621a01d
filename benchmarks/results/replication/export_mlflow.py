"""Export the replication's MLflow sqlite stores to JSON (one mlflow-<store>.json per mlflow-<store>.db).

Each JSON holds, per run: id, name, status, start/end time, params, tags and every metric's full history
(step, value). That is everything the replication report uses from the stores (the tokens/s windows and
the validation losses); the .db files themselves are not kept in the repository.

    python benchmarks/results/replication/export_mlflow.py benchmarks/results/replication/mlflow-*.db
"""

import json
import sqlite3
import sys
from pathlib import Path


def export(db: Path) -> dict:
    con = sqlite3.connect(db)
    runs = {}
    for run_id, name, status, start, end in con.execute(
            "select run_uuid, name, status, start_time, end_time from runs order by start_time"):
        runs[run_id] = {"run_id": run_id, "name": name, "status": status, "start_time": start, "end_time": end,
                        "params": {}, "tags": {}, "metrics": {}}
    for run_id, key, value in con.execute("select run_uuid, key, value from params order by key"):
        runs[run_id]["params"][key] = value
    for run_id, key, value in con.execute("select run_uuid, key, value from tags order by key"):
        runs[run_id]["tags"][key] = value
    for run_id, key, step, value in con.execute(
            "select run_uuid, key, step, value from metrics order by key, step, timestamp"):
        runs[run_id]["metrics"].setdefault(key, []).append([step, value])
    con.close()
    return {"store": db.stem, "runs": list(runs.values())}


def main(paths: list[str]) -> int:
    for path in map(Path, paths):
        out = path.with_suffix(".json")
        out.write_text(json.dumps(export(path), separators=(",", ":")) + "\n")
        print(f"{path} -> {out} ({out.stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
