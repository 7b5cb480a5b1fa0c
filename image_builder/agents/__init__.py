"""Agents: sandboxes that last for a task's whole conversation, on a store's instances.

    sandbox.py           open_sandbox(store, instance_id | task, access): an AgentSandbox (runtime/
                         sandbox.py's Sandbox on the instance's layers) started in a test-access
                         mode, with the candidate patch as diff() and score() in a fresh instance
    inspect_provider.py  the Inspect AI sandbox provider "image_builder" (entry point inspect_ai),
                         submission_scorer() and the test_feedback() tool
    miniswe.py           ImageBuilderEnvironment, a mini-swe-agent environment class

May import: errors, store, runtime, graders.
"""
