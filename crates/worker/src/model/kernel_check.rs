//! Kernel tests for one instruction set run only on a CPU that has it. A bare `if avx512() { … }`
//! passes in silence on a CPU without it, as if it had checked. [`on_cpu_with`] runs the check
//! or says that it skipped, on the test process's stderr past the harness's capture, so that every
//! run's log (CI's included) shows which kernels were checked on that machine.

use std::{cell::RefCell, io::Write};

/// Run `check` when the CPU has the instructions of `kernels` (`present`), and report either way.
pub(crate) fn on_cpu_with(present: bool, kernels: &str, check: impl FnOnce()) {
    if present {
        check();
    }
    report(present, kernels);
}

thread_local! {
    /// What this thread (one test: the harness runs each on its own) has reported already.
    static REPORTED: RefCell<Vec<(bool, String)>> = const { RefCell::new(Vec::new()) };
}

/// One line per kernel test and instruction set: checked, or skipped.
pub(crate) fn report(ran: bool, kernels: &str) {
    let first = REPORTED.with_borrow_mut(|said| {
        let new = !said.iter().any(|(r, k)| *r == ran && k == kernels);
        if new {
            said.push((ran, kernels.to_string()));
        }
        new
    });
    if !first {
        return;
    }
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a kernel test");
    let verdict = if ran { "checked" } else { "SKIPPED, this CPU lacks them" };
    // Written to the stream itself: `eprintln!` goes to the harness's capture, shown only on failure.
    let _ = writeln!(std::io::stderr(), "kernel test {test}: {kernels} {verdict}");
}
