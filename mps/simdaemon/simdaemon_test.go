package simdaemon

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

func TestCommands(t *testing.T) {
	// One daemon takes the commands in order: each row sees the rows before.
	d := &Daemon{log: io.Discard, threads: "100.0", memLimit: map[string]string{}}
	for _, tt := range []struct {
		line, answer string
		quit         bool
	}{
		{"get_default_active_thread_percentage", "100.0", false},
		{"set_default_active_thread_percentage 25", "25.0", false},
		{"get_default_active_thread_percentage", "25.0", false},
		{"set_default_active_thread_percentage 0", `invalid active thread percentage "0": want 1 to 100`, false},
		{"set_default_active_thread_percentage 101", `invalid active thread percentage "101": want 1 to 100`, false},
		{"set_default_active_thread_percentage NaN", `invalid active thread percentage "NaN": want 1 to 100`, false},
		{"get_default_active_thread_percentage", "25.0", false},
		{"get_default_device_pinned_mem_limit 0", "0M", false},
		{"set_default_device_pinned_mem_limit 0 10240M", "", false},
		{"get_default_device_pinned_mem_limit 0", "10240M", false},
		{"set_default_device_pinned_mem_limit 0 10240", `invalid pinned memory limit "10240": want a size with a unit, e.g. 1024M`, false},
		{"get_default_device_pinned_mem_limit 0", "10240M", false},
		{"get_server_list", "", false},
		{"set_active_thread_percentage 4242 25", "Server 4242 not found", false},
		{"start_server -uid 0", `Unrecognized command "start_server"`, false},
		{"quit", "", true},
	} {
		answer, quit := d.do(tt.line)
		if answer != tt.answer || quit != tt.quit {
			t.Errorf("%q: answer %q, quit %v; want %q, %v", tt.line, answer, quit, tt.answer, tt.quit)
		}
	}
}

// Serve takes commands through its socket, keeps its pid file and log as
// the real daemon does, and goes on quit, removing its pid file and socket.
// The pipe directory's path is longer than a unix socket address holds.
func TestServeAndControl(t *testing.T) {
	root := t.TempDir()
	deep := filepath.Join(root, strings.Repeat("d", 60), "GPU-0c3e2ad4-4b51-5b8e-9a70-61b8f1d05b52")
	for _, tt := range []struct{ name, dir string }{{"short path", root}, {"path over 108 bytes", deep}} {
		t.Run(tt.name, func(t *testing.T) {
			env := Env{PipeDir: filepath.Join(tt.dir, "pipe"), LogDir: filepath.Join(tt.dir, "log"), Device: "GPU-x"}
			d, err := Listen(env)
			if err != nil {
				t.Fatal(err)
			}
			served := make(chan error, 1)
			go func() { served <- d.Serve(context.Background()) }()
			out, err := Control(env, "set_default_active_thread_percentage 50", "get_default_active_thread_percentage")
			if err != nil || out != "50.0\n50.0\n" {
				t.Fatalf("Control: %q, %v; want the percentage set and read back", out, err)
			}
			pid, err := os.ReadFile(filepath.Join(env.PipeDir, pidFileName))
			if err != nil || strings.TrimSpace(string(pid)) != strconv.Itoa(os.Getpid()) {
				t.Errorf("pid file %q, %v; want this process's pid", pid, err)
			}
			if _, err := Control(env, "quit"); err != nil {
				t.Fatal(err)
			}
			if err := <-served; err != nil {
				t.Fatalf("Serve after quit: %v", err)
			}
			for _, f := range []string{pidFileName, socketName} {
				if _, err := os.Stat(filepath.Join(env.PipeDir, f)); !os.IsNotExist(err) {
					t.Errorf("%s left after quit: %v", f, err)
				}
			}
			log, _ := os.ReadFile(filepath.Join(env.LogDir, logName))
			for _, want := range []string{"set_default_active_thread_percentage 50", "quit"} {
				if !strings.Contains(string(log), want) {
					t.Errorf("control.log lacks %q:\n%s", want, log)
				}
			}
			if _, err := Control(env, "get_server_list"); err == nil {
				t.Error("Control answered after quit")
			}
		})
	}
}

// The servers ServersFile lists are the daemon's: get_server_list answers
// them and the per-server limits are taken for them, and only for them.
// control.log has the environment the daemon was started with.
func TestServersFileAndEnvLog(t *testing.T) {
	dir := t.TempDir()
	env := Env{PipeDir: filepath.Join(dir, "pipe"), LogDir: filepath.Join(dir, "log"), Device: "GPU-y"}
	d, err := Listen(env)
	if err != nil {
		t.Fatal(err)
	}
	defer d.logFile.Close()
	if answer, _ := d.do("get_server_list"); answer != "" {
		t.Errorf("get_server_list without %s: %q, want none", ServersFile, answer)
	}
	if err := os.WriteFile(filepath.Join(env.PipeDir, ServersFile), []byte("4242\n77\nnot-a-pid\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct{ line, answer string }{
		{"get_server_list", "4242\n77"},
		{"set_active_thread_percentage 4242 25", "25.0"},
		{"set_active_thread_percentage 4242 0", `invalid active thread percentage "0": want 1 to 100`},
		{"set_active_thread_percentage 5 25", "Server 5 not found"},
		{"set_device_pinned_mem_limit 77 0 1024M", ""},
		{"set_device_pinned_mem_limit 77 0 1024", `invalid pinned memory limit "1024": want a size with a unit, e.g. 1024M`},
	} {
		if answer, _ := d.do(tt.line); answer != tt.answer {
			t.Errorf("%q: %q, want %q", tt.line, answer, tt.answer)
		}
	}
	log, err := os.ReadFile(filepath.Join(env.LogDir, logName))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"CUDA_VISIBLE_DEVICES=GPU-y", "CUDA_MPS_PIPE_DIRECTORY=" + env.PipeDir, "CUDA_MPS_LOG_DIRECTORY=" + env.LogDir} {
		if !strings.Contains(string(log), want) {
			t.Errorf("control.log lacks %q:\n%s", want, log)
		}
	}
}
