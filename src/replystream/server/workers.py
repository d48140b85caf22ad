"""``serve --workers N``: N processes of ``replystream serve`` on one port, and the parent
that supervises them.

Each worker listens on a socket of its own, bound to the port with ``SO_REUSEPORT``, which the
parent opens for it and hands it (``--listen-fd``): the kernel spreads new connections evenly
over the workers. (On one shared socket, whichever worker woke first took every connection
queued, a burst of 40 all on one of four workers.) The parent holds the port with a socket
that does not listen, so it stays the server's while every worker restarts; a worker's socket
is closed when the worker closes it (as it begins to stop) or exits, so new connections go to
the others until its replacement, on a new socket, is started.

This file decides when the server says it is listening (once every worker accepts
connections), how soon a worker that exited is started again, and how the workers are
stopped. It must not know what a worker serves: to the parent a worker is a command line, the
socket it inherits, and one byte on a pipe when it accepts connections.

How a worker tells its parent it is ready: a pipe per worker, whose write end the worker
inherits (``--ready-fd``); it writes one byte once it accepts connections, then closes it.
A pipe because the kernel closes the worker's end when the worker dies, however it dies, so a
worker that never gets ready is an end of file at once, with no timeout or polling to tune;
because the worker's stdout is the parent's own (where the ready line goes, for tools to
read); and because nothing of it outlives the processes (a socket or a file would need a name,
and cleaning up).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.multiprocess import mark_process_dead

from replystream import start_interrupt
from replystream.server import metrics_dir
from replystream.server.listening import (
    HURRY_SIGNAL,
    REFUSED_EXIT,
    also_listening,
    listening_lines,
    url_of,
)
from replystream.server.listening import announce as announce_lines
from replystream.server.metrics import MULTIPROCESS_DIR_ENV
from replystream.server.restart_backoff import RestartBackoff

log = logging.getLogger("replystream.server")

# The exit status of ``serve --workers`` when a worker exits before every worker was ready:
# the server never served, and says so instead of restarting what may never start.
START_FAILED_EXIT = 1
# The exit status when a worker did not stop gracefully: it had to be killed at the stop (it
# did not stop in time), or it ended otherwise during it (a crash, a SIGKILL from outside).
KILLED_AT_STOP_EXIT = 1
# What a worker writes on its ready pipe.
READY_BYTE = b"R"
# How often the parent looks for workers that exited (a worker getting ready wakes it at once).
POLL_S = 0.1
# How long past the shutdown grace a worker may take to stop before the parent kills it: a
# worker that stops gracefully is done a few seconds past the grace (its WebSockets take up
# to 7: 2 s to send their last events, 5 s for the client's close); one that is not is stuck.
STOP_MARGIN_S = 10.0


def tell_parent_ready(fd: int) -> None:
    """Tell the parent of ``--workers`` that this worker accepts connections: one byte on
    the pipe it gave us (``--ready-fd``), then closed."""
    try:
        os.write(fd, READY_BYTE)
    except OSError:
        pass  # the parent is gone: this worker notices, and stops (``--parent-pid``)
    finally:
        os.close(fd)


def open_descriptors() -> int:
    """How many files this process has open now (its descriptors; 3, stdio's, where the
    system does not list them)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder)) - 1  # (the listing's own)
        except OSError:
            continue
    return 3


def descriptors_problem(workers: int) -> str | None:
    """What ``--workers`` too many for the files a process may open (``ulimit -n``) is,
    said; None when they fit. The parent keeps two files open per worker (the worker's
    listening socket and its ready pipe), and starting one takes three more for a moment;
    beside those it holds the port, its wait for the workers and the file of its count of
    restarts, and what it has open now."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = open_descriptors() + 3 + 2 * workers + 3
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return None
    return (
        f"--workers {workers}: the parent keeps 2 files open per worker, {needed} files in "
        f"all here, past the {soft} a process may open (ulimit -n): lower --workers, or "
        f"raise ulimit -n (each worker needs many more for its connections)"
    )


def too_many_files(workers: int) -> str:
    """The end of the line for a worker that could not be started for want of files."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (
        f"out of the {soft} files a process may open (ulimit -n) with --workers {workers}: "
        "lower --workers, or raise ulimit -n"
    )


def run_workers(
    argv: list[str],
    workers: int,
    sock: socket.socket,
    announce: Callable[[str], list[str]] = listening_lines,
    *,
    reloads: bool = False,
    grace_s: float = 10.0,
) -> int:
    """Run ``workers`` processes of ``replystream serve`` accepting connections on one port.

    The parent has bound ``sock`` (``bind_socket(shared=True)``: it holds the port, and does not
    listen); it starts each worker with a listening socket of its own on that port
    (``--listen-fd``), and the kernel hands each new connection to one of them. It prints
    ``announce(url)`` once every worker accepts connections; a worker that exits before that
    stops the server (``START_FAILED_EXIT``), without that line. The parent forwards SIGINT and
    SIGTERM (each worker then shuts down gracefully; one still starting, deaf to SIGINT, gets
    SIGTERM; a second sends the serving workers ``HURRY_SIGNAL``, which ends their grace),
    starts again a worker that exits on its own (waiting longer after each exit in a
    row of its slot: ``restart_backoff``), and returns when all have stopped: a worker still
    there ``STOP_MARGIN_S`` past the shutdown grace (``grace_s``) is killed. A worker that
    refuses to start (``REFUSED_EXIT``: its command line, or a file it names, cannot be served)
    before the server is ready stops it: the parent stops the others and returns
    ``REFUSED_EXIT``; one restarted later is started again as after any exit, the others serving
    on. The workers share their metrics through files in a fresh folder
    (``MULTIPROCESS_DIR_ENV``), so any worker's ``/metrics`` counts them all; the parent removes
    it when it returns, and, as it starts, those that parents killed outright left behind
    (``metrics_dir``). With ``reloads`` (the workers read a file again on SIGHUP), the parent
    forwards SIGHUP to each worker once it is ready (one still starting gets it when it is: it
    may have read the file before the edit), and sends it to every worker once one started
    again in a dead one's place is ready (it read the files as they are now, the others as
    they were when last signalled: an edit not yet signalled would be served by it alone);
    without, a SIGHUP stops the workers as SIGTERM does.
    """
    metrics_dir.remove_stale_folders()
    with metrics_dir.owned_folder() as folder:
        supervisor = Supervisor(argv, workers, sock, folder, kill_after_s=grace_s + STOP_MARGIN_S)
        return supervisor.run(announce, reloads=reloads)


def _ignore_interrupts() -> None:
    """In a new worker, before it runs: SIGINT ignored (Python keeps an inherited SIG_IGN)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass(slots=True)
class Slot:
    """One worker's place: the process in it now (None while its restart waits)."""

    backoff: RestartBackoff = field(default_factory=RestartBackoff)
    process: subprocess.Popen[bytes] | None = None
    listening: socket.socket | None = None  # the parent's copy of its worker's socket, until ready
    ready_pipe: int | None = None  # our end, until the worker said it is ready or died
    serving_since: float | None = None  # when it said it is ready (monotonic)
    restart_at: float | None = None
    hangup_due: bool = False  # a SIGHUP came while it was starting: it gets one when ready


class Supervisor:
    """The parent's loop: start the workers, say when the server is ready, restart the
    workers that exit, stop them all on a signal or a refusal."""

    def __init__(
        self,
        argv: list[str],
        workers: int,
        sock: socket.socket,
        folder: str,
        *,
        kill_after_s: float,
    ) -> None:
        self._holder = sock
        self._command = [
            sys.executable,
            "-m",
            "replystream",
            "serve",
            *argv,
            "--parent-pid",
            str(os.getpid()),
        ]
        self._env = {**os.environ, MULTIPROCESS_DIR_ENV: folder}
        self._folder = folder
        self._restarts = metrics_dir.RestartCount(folder)
        self._slots = [Slot() for _ in range(workers)]
        self._selector = selectors.DefaultSelector()
        self._announced = self._stopping = False
        self._hurried = False  # a second stop signal ended the workers' grace
        self._none_serving = False  # said that every worker is down, until one is ready
        self._reloads = False  # the workers read a file again on SIGHUP
        self._stop_signal: int = signal.SIGTERM
        self._status = 0
        # From the first stop signal: when a worker still there is killed.
        self._kill_after_s = kill_after_s
        self._kill_at: float | None = None
        self._killed: set[int] = set()  # the workers killed for not stopping (said already)

    def run(self, announce: Callable[[str], list[str]], *, reloads: bool = False) -> int:
        signal.signal(signal.SIGINT, self._forward)
        signal.signal(signal.SIGTERM, self._forward)
        if start_interrupt.interrupted():
            raise KeyboardInterrupt  # a Ctrl-C while the parent loaded, that code swallowed
        # With no file to read again, SIGHUP stops the workers as SIGTERM does.
        self._reloads = reloads
        signal.signal(signal.SIGHUP, self._hangup if reloads else self._stop_on_hangup)
        try:
            for slot in self._slots:
                self._start(slot)
            while not (self._stopping and all(s.process is None for s in self._slots)):
                self._wait()
                if self._stopping:
                    # The workers stop listening as they take the signal; while these copies
                    # are open the kernel would still queue new connections, unanswered.
                    for slot in self._slots:
                        self._stop_listening(slot)
                now = time.monotonic()
                for slot in self._slots:
                    self._reap(slot, now)
                if self._kill_at is not None and now >= self._kill_at:
                    self._kill_the_stuck()
                if not self._announced and not self._stopping:
                    if all(slot.serving_since is not None for slot in self._slots):
                        announce_lines(announce(url_of(self._holder)))
                        log.warning("%d workers share the port", len(self._slots))
                        self._announced = True
                for slot in self._slots:
                    if slot.restart_at is not None and slot.restart_at <= now:
                        self._start(slot, again=True)
            # Every worker is gone: a signal now has nothing to stop, forward or read again,
            # and as the interpreter exits it gives each handled signal its default back, so
            # one landing then (a reload sent as the server stops) would kill the parent.
            for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_IGN)
        finally:
            for slot in self._slots:
                self._close_pipe(slot)
                self._stop_listening(slot)
            self._selector.close()
            self._holder.close()
        return self._status

    def _start(self, slot: Slot, again: bool = False) -> None:
        slot.restart_at = slot.serving_since = None
        slot.hangup_due = False  # a new worker reads the file as it starts
        if self._stopping:
            return
        try:
            if slot.listening is None:
                # A listening socket is given its share of new connections at once, queued
                # until its worker accepts them: for the whole of a start (imports, a
                # model's load: seconds), or reset if it dies before. While other workers
                # serve, they take them instead, and this worker listens once it is ready.
                # With none serving (the first start, every worker down) they are better
                # queued than refused.
                slot.listening = also_listening(self._holder, listens=not self._serving())
        except OSError as exc:
            self._cannot_start(slot, f"cannot listen for a worker: {self._why(exc)}")
            return
        listening = slot.listening.fileno()
        try:
            read_end, write_end = os.pipe()
        except OSError as exc:
            self._cannot_start(slot, f"cannot start a worker: {self._why(exc)}")
            return
        try:
            slot.process = subprocess.Popen(
                [*self._command, "--listen-fd", str(listening), "--ready-fd", str(write_end)],
                pass_fds=(listening, write_end),
                env=self._env,
                # Deaf to SIGINT until it serves (its loop then takes it): a terminal's Ctrl-C
                # reaches every process of its group, and a worker still importing would
                # die of it with a traceback. The parent stops such a worker with SIGTERM.
                preexec_fn=_ignore_interrupts,
            )
        except OSError as exc:
            os.close(read_end)
            self._cannot_start(slot, f"cannot start a worker: {self._why(exc)}")
            return
        finally:
            # Only the worker holds the write end now: its exit is our end of file.
            os.close(write_end)
        slot.ready_pipe = read_end
        self._selector.register(read_end, selectors.EVENT_READ, slot)
        if again:
            self._restarts.add_one()
        if self._stopping:  # a signal came while it was being started: it missed the forward
            self._signal(slot, self._stop_signal)

    def _wait(self) -> None:
        """Until a worker says it is ready (or dies before), a restart is due, or ``POLL_S``."""
        timeout = POLL_S
        due = [slot.restart_at for slot in self._slots if slot.restart_at is not None]
        if self._kill_at is not None:
            due.append(self._kill_at)
        if due:
            timeout = max(0.0, min(timeout, min(due) - time.monotonic()))
        for key, _ in self._selector.select(timeout):
            slot = key.data
            try:
                said = os.read(key.fd, 1)
            except OSError:
                said = b""
            self._close_pipe(slot)
            if said == READY_BYTE:
                slot.serving_since = time.monotonic()
                # It listens on its own copy now. Ours would keep its socket open once it
                # closes it, as it does when it begins to stop (a SIGTERM sent to it alone):
                # the kernel would go on queueing it new connections that nobody accepts
                # for the whole of its drain, instead of handing them to the others.
                self._stop_listening(slot)
                if self._announced and slot.process is not None:  # after a restart: recovered
                    log.warning("worker %d is ready, in place of one that exited", slot.process.pid)
                    if self._none_serving:
                        self._none_serving = False
                        log.warning("a worker is serving again")
                if self._announced and self._reloads and not self._stopping:
                    # It read its files as they are now; the others, as they were at their
                    # last reload. Unless all read them again, an edit not yet signalled (a
                    # phrase banned, a key revoked) would be served by this one alone, and a
                    # client's request served by either version as its connection lands.
                    log.warning(
                        "every worker reads its files again, as the one started again read "
                        "them: all serve them as they are now"
                    )
                    slot.hangup_due = False
                    self._hangup(signal.SIGHUP, None)
                if slot.hangup_due and slot.process is not None:
                    slot.hangup_due = False
                    slot.process.send_signal(signal.SIGHUP)
            # An end of file: it died before it was ready; ``_reap`` reads how.

    def _reap(self, slot: Slot, now: float) -> None:
        """Deal with the slot's worker if it has exited."""
        process = slot.process
        if process is None or (status := process.poll()) is None:
            return
        self._close_pipe(slot)
        # Closed with it: the kernel hands new connections to the others' sockets (those it
        # had queued for this one are refused) until another is ready in its place on a new one.
        self._stop_listening(slot)
        slot.process = None
        # Its counts stay in the totals; what it held (live gauges) does not.
        mark_process_dead(process.pid, self._folder)  # type: ignore[no-untyped-call]
        if not self._stopping:  # (the folder goes when the server stops)
            try:
                metrics_dir.absorb(self._folder, process.pid)
            except (OSError, RuntimeError, struct.error) as exc:  # a file half written: kept
                log.warning(
                    "the metrics of worker %d stay in files of their own: %s", process.pid, exc
                )
        if self._stopping:
            self._ended_in_the_stop(slot, process.pid, status)
            return
        ended = f"worker {process.pid} {how_it_ended(status)}"
        if status == REFUSED_EXIT and not self._announced:
            log.error("%s: it refused to start (said above); stopping", ended)
            self._stop(REFUSED_EXIT)
        elif status == REFUSED_EXIT:
            # A restart that refuses what a file now says (a keys or routes file emptied
            # since, which the others, still serving, refused to reload): they go on; the
            # slot tries again as after any exit, and starts once the file is fixed.
            restart = slot.backoff.after_exit(None)
            slot.restart_at = now + restart.delay_s
            log.error(
                "%s: it refused to start (said above); the other workers go on serving; "
                "trying again in %.1f s",
                ended,
                restart.delay_s,
            )
        elif not self._announced:
            self._cannot_start(slot, f"{ended} before every worker was ready")
        else:
            served = None if slot.serving_since is None else now - slot.serving_since
            restart = slot.backoff.after_exit(served)
            slot.restart_at = now + restart.delay_s
            log.error(
                "%s %s; starting another in %.1f s (exit %d in a row of this worker's place)",
                ended,
                "before it was ready" if served is None else f"after serving {served:.1f} s",
                restart.delay_s,
                restart.in_a_row,
            )
        if self._announced and not self._none_serving and not self._serving():
            # Each exit is said, but not that they add up to a server that answers nobody.
            self._none_serving = True
            log.error("no worker is serving: new connections are refused until one is ready")

    def _serving(self) -> int:
        """The workers that accept connections now."""
        return sum(s.process is not None and s.serving_since is not None for s in self._slots)

    def _ended_in_the_stop(self, slot: Slot, pid: int, status: int) -> None:
        """A worker that exited once the server was stopping: gracefully is status 0 (or, one
        not serving yet, SIGTERM's own end: it had nothing to finish). Any other end of a
        worker that served cut its replies, so it is said, and in the exit status, as a worker
        killed for not stopping; one that ended otherwise in its own start (a restart) had no
        replies to cut: what happened is said, and the stop stays graceful."""
        graceful = status == 0 or (status == -signal.SIGTERM and slot.serving_since is None)
        # Before the server was ready, a start that failed stops it: the others refusing too
        # (status 2, each said) or killed in their start have no replies to cut.
        if graceful or pid in self._killed or not self._announced:
            return
        if slot.serving_since is None:
            log.warning(
                "worker %d %s before it was ready, while the server stopped: it had no replies",
                pid,
                how_it_ended(status),
            )
            return
        log.error(
            "worker %d %s while the server stopped: its replies were cut", pid, how_it_ended(status)
        )
        self._status = self._status or KILLED_AT_STOP_EXIT

    def _why(self, exc: OSError) -> str:
        """Why a worker could not be had: past the files a process may open, said with
        ``--workers`` and the limit; otherwise as the system says it."""
        if exc.errno == errno.EMFILE:
            return too_many_files(len(self._slots))
        return exc.strerror or str(exc)

    def _cannot_start(self, slot: Slot, what: str) -> None:
        """A worker could not be started, or exited: before the server was ready that stops
        it; after, the slot waits as after an exit."""
        if not self._announced:
            log.error("%s; stopping: the server cannot start", what)
            self._stop(START_FAILED_EXIT)
            return
        restart = slot.backoff.after_exit(None)
        slot.restart_at = time.monotonic() + restart.delay_s
        log.error("%s; trying again in %.1f s", what, restart.delay_s)

    def _stop(self, status: int) -> None:
        self._status = status
        if not self._stopping:  # (stopping already: no operator asked to hurry)
            self._forward(signal.SIGTERM, None)

    def _forward(self, signum: int, _frame: object) -> None:
        if self._stopping:
            self._hurry()
            return
        # Before the workers hear of it: each then answers /healthz for a server that
        # stops, not for a worker stopping alone while the others serve.
        metrics_dir.mark_stopping(self._folder)
        self._stopping, self._stop_signal = True, signum
        if self._kill_at is None:
            self._kill_at = time.monotonic() + self._kill_after_s
        for slot in self._slots:
            slot.restart_at = None
            if slot.process is not None and slot.process.poll() is None:
                self._signal(slot, signum)

    def _hurry(self) -> None:
        """Stopped again: the serving workers end their grace now, telling the replies still
        running ``shutdown`` in-band (one still starting has none, and was sent SIGTERM)."""
        if self._hurried:
            return
        self._hurried = True
        log.warning("stopped again: the workers' grace ends now")
        for slot in self._slots:
            process = slot.process
            if process is not None and process.poll() is None and slot.serving_since is not None:
                process.send_signal(HURRY_SIGNAL)

    def _kill_the_stuck(self) -> None:
        """Kill the workers still there well past the grace (a hung loop, a stopped process):
        the server must exit."""
        self._kill_at = math.inf
        for slot in self._slots:
            if slot.process is not None and slot.process.poll() is None:
                log.error(
                    "worker %d did not stop within the shutdown grace and %g s: killed",
                    slot.process.pid,
                    STOP_MARGIN_S,
                )
                slot.process.kill()
                self._killed.add(slot.process.pid)
                # The stop was not graceful: its replies were cut. Said in the exit status, so
                # systemd or a CI script sees it (unless a failure already set one).
                self._status = self._status or KILLED_AT_STOP_EXIT

    @staticmethod
    def _signal(slot: Slot, signum: int) -> None:
        """Stop the slot's worker: with ``signum`` once it serves (its loop stops gracefully
        on SIGINT or SIGTERM); before, with SIGTERM, since it ignores SIGINT until then (and
        has nothing to finish)."""
        assert slot.process is not None
        slot.process.send_signal(signum if slot.serving_since is not None else signal.SIGTERM)

    def _stop_on_hangup(self, _signum: int, frame: object) -> None:
        if not self._stopping:  # a terminal closed after its Ctrl-C is no second stop
            self._forward(signal.SIGTERM, frame)

    def _hangup(self, _signum: int, _frame: object) -> None:
        for slot in self._slots:
            if slot.process is None or slot.process.poll() is not None:
                continue
            if slot.serving_since is None:
                slot.hangup_due = True
            else:
                slot.process.send_signal(signal.SIGHUP)

    @staticmethod
    def _stop_listening(slot: Slot) -> None:
        if slot.listening is not None:
            slot.listening.close()
            slot.listening = None

    def _close_pipe(self, slot: Slot) -> None:
        if slot.ready_pipe is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(slot.ready_pipe)
            os.close(slot.ready_pipe)
            slot.ready_pipe = None


def how_it_ended(status: int) -> str:
    """A process's exit, as ``Popen.returncode`` gives it, in words."""
    if status >= 0:
        return f"exited with status {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    return f"was killed by {name}"
