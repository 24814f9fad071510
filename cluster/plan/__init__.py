"""Which deployment to run: the profiler (`profiler`: measured step and transfer costs), a
discrete-event simulator of the whole cluster that drives the router's own placement (`simulator`,
over simulated engines, `sim_engine`), and the planner that searches deployments with it (`planner`).
The simulator is apart from the runtime: nothing here runs while a cluster serves. A cluster that
starts reads a stored profile's prompt-pass costs (`costs.find_stored_profile`) and nothing else."""
