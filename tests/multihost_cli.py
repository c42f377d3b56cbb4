"""``agentrl-jax`` as a script for the local cluster (tests/multihost.py appends the cluster
flags to its arguments): ``python multihost_cli.py reproduce frozenlake ...``."""

from agentrl_jax.cli import main

if __name__ == "__main__":
    main()
