from jobs import scheduler
from jobs.management.schedules import ScheduleToggleCommand


class Command(ScheduleToggleCommand):
    help = "Pause a recurring schedule: no slot runs until it is resumed."
    action = staticmethod(scheduler.pause)
