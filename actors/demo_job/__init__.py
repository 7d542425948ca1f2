"""paramsync.actors.demo_job."""
