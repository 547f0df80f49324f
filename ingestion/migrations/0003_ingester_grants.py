from django.db import migrations

from ingestion.grants import grant_from_settings


class Migration(migrations.Migration):
    dependencies = [("ingestion", "0002_spool")]

    operations = [migrations.RunPython(grant_from_settings, migrations.RunPython.noop)]
