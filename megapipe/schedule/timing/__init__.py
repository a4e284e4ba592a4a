"""When each action runs: the dependency rules, the in-order engine, timelines."""
