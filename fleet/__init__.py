"""The host's fleet operations over MQTT, speaking tandoor_contract.protocol:

    client      the broker connection (Fleet): devices, job status, commands, cancel, key commands
    rollout     Rollout: plan, run_wave, judge, judge_canaries (what `tandoor fleet deploy` runs)
    artifacts   ArtifactServer: the bundle over HTTP with Range requests (--transport url --serve)
"""
