//! CPU time from `/proc`: of given processes (all their threads: user + system), and of the whole
//! machine, read before and after a measured phase.

use anyhow::Context;

/// Seconds of CPU a process (every thread of it) has used so far in user and in system mode:
/// `utime` and `stime` of `/proc/PID/stat`.
pub fn process_cpu_s(pid: u32) -> anyhow::Result<(f64, f64)> {
    let stat =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces and parentheses: fields are counted after its
    // closing parenthesis, where field 3 (state) is index 0.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("malformed /proc/PID/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<u64> { Ok(fields.get(i).context("short /proc/PID/stat")?.parse()?) };
    let (utime, stime) = (ticks(14 - 3)?, ticks(15 - 3)?);
    let hz = clock_ticks_per_s();
    Ok((utime as f64 / hz, stime as f64 / hz))
}

/// Busy and total CPU seconds of the machine, summed over its cores (`/proc/stat`).
pub fn machine_cpu_s() -> anyhow::Result<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("empty /proc/stat")?;
    let ticks: Vec<u64> = line.split_whitespace().skip(1).map(str::parse).collect::<Result<_, _>>()?;
    let total: u64 = ticks.iter().take(8).sum();
    // idle and iowait
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    let hz = clock_ticks_per_s();
    Ok(((total - idle) as f64 / hz, total as f64 / hz))
}

fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_used_some_cpu_and_the_machine_more() {
        // Spin until the kernel has charged this process a clock tick (at most 5 s).
        let give_up = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let own = loop {
            let (user, system) = process_cpu_s(std::process::id()).unwrap();
            if user + system > 0.0 || std::time::Instant::now() > give_up {
                break user + system;
            }
            std::hint::spin_loop();
        };
        let (busy, total) = machine_cpu_s().unwrap();
        assert!(own > 0.0 && busy >= own && total >= busy, "{own} {busy} {total}");
    }
}
