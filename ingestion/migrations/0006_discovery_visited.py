"""The listing pages a discovery run has read, so that pages pointing back at each other
(a feed's ``next`` links in a circle, sitemap indexes naming each other) are read once."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("ingestion", "0005_search")]

    operations = [
        migrations.AddField(
            model_name="discoveryrun",
            name="visited",
            field=models.JSONField(
                blank=True,
                default=list,
                help_text="listing pages this run has read, never read twice",
            ),
        ),
    ]
