"""Helpers the tests share, imported as a package (``from support.cli import run_cli``):

    cli           run the real CLIs in subprocesses; compile a model once per session
    bundle_edit   rewrite bundles' members and manifests (for tamper and fault tests)
    mosquitto     a real mosquitto broker on a free loopback port, and a recording client
    sysfs_trees   fake sysfs trees of real boards (power sensors, thermal zones)
"""
