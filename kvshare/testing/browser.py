"""Headless Chromium (Debian's ``chromium`` + ``chromium-driver``) driven by Selenium, for the
live page's browser test and the demo's screenshot. ``make browser`` installs the packages.

The driver is the system ``chromedriver`` (Selenium Manager never downloads one); the browser
runs with ``--no-sandbox`` (root in containers and CI) and ``--disable-background-networking``
(no calls home), so a page that needs the internet shows up as broken, not as slow.
"""

from __future__ import annotations

import shutil
from typing import Any

CHROME_ARGS = ("--headless=new", "--no-sandbox", "--disable-background-networking",
               "--disable-gpu", "--disable-dev-shm-usage", "--disable-extensions",
               "--no-first-run")


def missing() -> str:
    """Why a headless browser cannot start here ("" when it can)."""
    if shutil.which("chromedriver") is None or shutil.which("chromium") is None:
        return "chromium/chromedriver not installed (run `make browser`, as root)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install -e '.[test]')"
    return ""


def headless_chromium(width: int = 1400, height: int = 1000) -> Any:
    """A Selenium Chrome WebDriver on the system chromium; the caller calls ``quit()``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    why = missing()
    if why:
        raise RuntimeError(why)
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(shutil.which("chromium"))
    for arg in CHROME_ARGS:
        opts.add_argument(arg)
    opts.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")),
                            options=opts)


def screenshot(url: str, path: str, wait_for_css: str = "body[data-updated]",
               timeout_s: float = 20.0, height: int = 0) -> None:
    """Open ``url``, wait until ``wait_for_css`` matches, save a PNG of the page at ``path``
    (``height`` > 0: resize the window to that, else to the page's full height)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = headless_chromium()
    try:
        driver.get(url)
        WebDriverWait(driver, timeout_s).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, wait_for_css))
        for _ in range(2):  # the page re-lays out at the new width: measure twice
            full = height or int(driver.execute_script(
                "return document.documentElement.scrollHeight"))
            driver.set_window_size(1400, min(max(full + 160, 600), 4000))
        driver.save_screenshot(path)
    finally:
        driver.quit()
