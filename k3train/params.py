"""Print the total and active parameter counts of a config as JSON.

    python -m k3train.params model=k3
"""

from __future__ import annotations

import json
import sys

from k3train.config.load import load_config
from k3train.config.param_count import count_params
from k3train.config.validate import validate_model


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    validate_model(cfg.model)
    counts = count_params(cfg.model)
    print(json.dumps({"model": cfg.model.name, "total": counts.total, "active": counts.active,
                      "total_billions": round(counts.total / 1e9, 3), "active_billions": round(counts.active / 1e9, 3)}))


if __name__ == "__main__":
    main()
