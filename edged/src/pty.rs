//! A pseudo-terminal for `exec` with `tty`: the command gets the terminal end as its stdin,
//! stdout and stderr; edged reads and writes the other end without blocking a worker.

use std::io;
use std::os::fd::OwnedFd;

use rustix::pty::OpenptFlags;
use tokio::io::unix::AsyncFd;

/// Readiness of the controlling end.
pub type Ready<'a> = tokio::io::unix::AsyncFdReadyGuard<'a, OwnedFd>;

/// A read of the controlling end: Linux says EIO once no process holds the terminal, which is
/// its end of output (`Ok(0)`).
fn read(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    match rustix::io::read(fd, buf) {
        Err(rustix::io::Errno::IO) => Ok(0),
        other => other.map_err(io::Error::from),
    }
}

/// The controlling end of a pseudo-terminal, non-blocking and registered with tokio.
pub struct Pty {
    master: AsyncFd<OwnedFd>,
}

impl Pty {
    /// Opens a pseudo-terminal: `(the controlling end, the terminal the command gets)`.
    pub fn open() -> io::Result<(Pty, OwnedFd)> {
        let master =
            rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
        rustix::pty::grantpt(&master)?;
        rustix::pty::unlockpt(&master)?;
        // TIOCGPTPEER (Linux 4.13) opens the peer without a path lookup in /dev/pts.
        let terminal = rustix::pty::ioctl_tiocgptpeer(
            &master,
            OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC,
        )?;
        rustix::io::ioctl_fionbio(&master, true)?;
        // tokio deprecates `new` for types whose `as_raw_fd` could change under it
        // (tokio-rs/tokio#8587); an `OwnedFd` the `AsyncFd` owns cannot, and the replacement,
        // `register`, is `unsafe`, which the workspace forbids.
        #[allow(deprecated)]
        let master = AsyncFd::new(master)?;
        Ok((Pty { master }, terminal))
    }

    /// Waits until the terminal has output (or has hung up).
    pub async fn readable(&self) -> io::Result<Ready<'_>> {
        self.master.readable().await
    }

    /// Waits until the terminal takes input.
    pub async fn writable(&self) -> io::Result<Ready<'_>> {
        self.master.writable().await
    }

    /// Reads output after [`Pty::readable`]: `None` when there was none after all (wait
    /// again), `Some(Ok(0))` once every holder of the terminal closed it.
    pub fn read(ready: &mut Ready<'_>, buf: &mut [u8]) -> Option<io::Result<usize>> {
        ready.try_io(|fd| read(fd.get_ref(), buf)).ok()
    }

    /// Reads output there is now, without waiting: `WouldBlock` when there is none.
    pub fn read_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        read(self.master.get_ref(), buf)
    }

    /// Writes input after [`Pty::writable`]: `None` when the terminal's input queue was full
    /// after all (wait again).
    pub fn write(ready: &mut Ready<'_>, data: &[u8]) -> Option<io::Result<usize>> {
        ready
            .try_io(|fd| rustix::io::write(fd.get_ref(), data).map_err(io::Error::from))
            .ok()
    }

    /// Sets the window size; the terminal signals SIGWINCH to its foreground process group.
    pub fn resize(&self, columns: u16, rows: u16) -> io::Result<()> {
        let size = rustix::termios::Winsize {
            ws_row: rows,
            ws_col: columns,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        rustix::termios::tcsetwinsize(self.master.get_ref(), size).map_err(io::Error::from)
    }

    /// The window size (for tests).
    #[cfg(test)]
    fn size(&self) -> io::Result<(u16, u16)> {
        let size = rustix::termios::tcgetwinsize(self.master.get_ref())?;
        Ok((size.ws_col, size.ws_row))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_command_sees_a_terminal_and_its_size() {
        let (pty, terminal) = Pty::open().expect("a pseudo-terminal");
        pty.resize(100, 30).expect("resize");
        assert_eq!(pty.size().expect("size"), (100, 30));
        let mut command = tokio::process::Command::new("setsid");
        command
            .args(["--ctty", "sh", "-c", "test -t 0 && test -t 1 && stty size"])
            .stdin(terminal.try_clone().expect("dup"))
            .stdout(terminal.try_clone().expect("dup"))
            .stderr(terminal);
        let mut child = command.spawn().expect("setsid");
        drop(command);
        let status = child.wait().await.expect("wait");
        let mut out = Vec::new();
        let mut buf = [0u8; 256];
        loop {
            let mut ready = tokio::time::timeout(std::time::Duration::from_secs(2), pty.readable())
                .await
                .expect("output or hang-up")
                .expect("readable");
            match Pty::read(&mut ready, &mut buf) {
                Some(Ok(0)) => break,
                Some(Ok(n)) => out.extend_from_slice(&buf[..n]),
                Some(Err(e)) => panic!("{e}"),
                None => {}
            }
        }
        assert!(status.success(), "{}", String::from_utf8_lossy(&out));
        assert_eq!(String::from_utf8_lossy(&out), "30 100\r\n");
    }
}
