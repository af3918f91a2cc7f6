"""Client-side benchmark tools: traces, load, replay, plots; never imported by the services."""
