"""What a run reports: metrics, utilisation, the log line and report.json, timings, cost, profiles, summaries, the model card."""
