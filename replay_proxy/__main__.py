from replay_proxy.cli import run

run()
