"""Agents: sandboxes that last for a task's whole conversation, on a store's instances.

    sandbox.py           open_sandbox(store, instance_id): an AgentSandbox (runtime/sandbox.py's
                         Sandbox on the instance's layers) with the candidate patch as diff()
    inspect_provider.py  the Inspect AI sandbox provider "image_builder" (entry point inspect_ai)

May import: errors, store, runtime, graders.
"""
