"""``python -m trainscope.producers.agent``: the agent without the rest of the CLI."""

from trainscope.producers.agent.cli import agent

if __name__ == "__main__":
    agent(prog_name="trainscope agent")
