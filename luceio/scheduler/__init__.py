from .scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest"]
