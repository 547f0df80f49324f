from jobs import scheduler
from jobs.management.schedules import ScheduleToggleCommand


class Command(ScheduleToggleCommand):
    help = "Resume a paused schedule from its next slot (slots missed while paused do not run)."
    action = staticmethod(scheduler.resume)
