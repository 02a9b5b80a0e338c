"""Pipeline parallelism: schedules as data (`schedules`), a simulator that runs them with
costs (`simulate`), and what draws the simulator's timeline (`draw`). (The executor that
runs the same lists with real transfers comes with the rest of pipeline parallelism.)"""
