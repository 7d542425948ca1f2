"""actors.demo_job."""
