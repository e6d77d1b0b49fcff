// Command fakemps stands in for nvidia-cuda-mps-control in tests. Run with -d
// it starts a daemon in the background (a re-exec of itself in a new session)
// that listens on a unix socket in CUDA_MPS_PIPE_DIRECTORY, writes its pid to
// nvidia-cuda-mps-control.pid there, and exits once the daemon is up. Run
// without arguments it is a client: it sends the lines of stdin to the daemon
// and prints the answers. The daemon appends every command to commands.log
// and its startup environment to env.log in CUDA_MPS_LOG_DIRECTORY.
//
// get_server_list answers the pids listed in FAKEMPS_SERVER_PIDS (space
// separated); quit makes the daemon exit.
package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

func main() {
	pipe, logDir := os.Getenv("CUDA_MPS_PIPE_DIRECTORY"), os.Getenv("CUDA_MPS_LOG_DIRECTORY")
	if pipe == "" || logDir == "" {
		fail("CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY must be set")
	}
	sock := filepath.Join(pipe, "control")
	switch {
	case len(os.Args) == 2 && os.Args[1] == "-d":
		launch(sock)
	case len(os.Args) == 2 && os.Args[1] == "--daemon":
		daemon(pipe, logDir, sock)
	case len(os.Args) == 1:
		client(sock)
	default:
		fail("usage: fakemps [-d]")
	}
}

func fail(msg string) {
	fmt.Fprintln(os.Stderr, msg)
	os.Exit(1)
}

// launch starts the daemon detached, like the real -d, and waits until it
// accepts connections.
func launch(sock string) {
	self, err := os.Executable()
	if err != nil {
		fail(err.Error())
	}
	cmd := exec.Command(self, "--daemon")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		fail(err.Error())
	}
	for range 500 {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	fail("daemon did not come up")
}

func daemon(pipe, logDir, sock string) {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "CUDA_") {
			env = append(env, kv)
		}
	}
	if err := os.WriteFile(filepath.Join(logDir, "env.log"), []byte(strings.Join(env, "\n")+"\n"), 0o644); err != nil {
		fail(err.Error())
	}
	os.Remove(sock)
	l, err := net.Listen("unix", sock)
	if err != nil {
		fail(err.Error())
	}
	pidFile := filepath.Join(pipe, "nvidia-cuda-mps-control.pid")
	if err := os.WriteFile(pidFile, []byte(fmt.Sprintf("%d\n", os.Getpid())), 0o644); err != nil {
		fail(err.Error())
	}
	record, err := os.OpenFile(filepath.Join(logDir, "commands.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		fail(err.Error())
	}
	var mu sync.Mutex
	for {
		c, err := l.Accept()
		if err != nil {
			fail(err.Error())
		}
		go func() {
			defer c.Close()
			sc := bufio.NewScanner(c)
			for sc.Scan() {
				line := strings.TrimSpace(sc.Text())
				if line == "" {
					continue
				}
				mu.Lock()
				fmt.Fprintln(record, line)
				mu.Unlock()
				switch f := strings.Fields(line); f[0] {
				case "get_server_list":
					for _, pid := range strings.Fields(os.Getenv("FAKEMPS_SERVER_PIDS")) {
						fmt.Fprintln(c, pid)
					}
				case "quit":
					os.Remove(sock)
					os.Remove(pidFile)
					os.Exit(0)
				case "set_default_active_thread_percentage", "set_default_device_pinned_mem_limit",
					"set_active_thread_percentage", "set_device_pinned_mem_limit":
				default:
					fmt.Fprintf(c, "unknown command %s\n", f[0])
				}
			}
		}()
	}
}

func client(sock string) {
	c, err := net.Dial("unix", sock)
	if err != nil {
		fail("Cannot find MPS control daemon process: " + err.Error())
	}
	if _, err := io.Copy(c, os.Stdin); err != nil {
		fail(err.Error())
	}
	c.(*net.UnixConn).CloseWrite()
	if _, err := io.Copy(os.Stdout, c); err != nil {
		fail(err.Error())
	}
}
