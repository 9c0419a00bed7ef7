"""Until train.py drops its retrofit (issue 41): the retrofit lives in lab/retrofit.py."""

from lab.retrofit import retrofit, transplant  # noqa: F401
