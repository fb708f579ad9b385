"""The KV store below the engines' pools: full blocks any engine computed, kept in a pool of
the deployment's DRAM (Mooncake Store, with an SSD tier below it), loaded by any engine
about to compute the same prefix.

``block_format`` names and lays out a block as a store object; ``backend`` talks to the
store; ``store`` is one engine process's write and read paths; ``prefix`` warms an engine's
prefix cache from the store before a prompt is planned; ``master`` starts the store's
master. The design: DESIGN.md ("Fleet cache"); settings and tiers: docs/operations.md.
"""
