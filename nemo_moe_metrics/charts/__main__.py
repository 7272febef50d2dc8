"""``python -m nemo_moe_metrics.charts --write``: regenerate the Vega specs."""

from nemo_moe_metrics.charts import main

raise SystemExit(main())
