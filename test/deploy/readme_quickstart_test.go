package deploy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// quickStartGPUs is how many GPUs `make run`'s simulated DGX A100 has.
const quickStartGPUs = 8

// probeConfig is the built-in default with a probe a second: the Quick start
// waits for "healthy at the next probe" twice, and the default interval (10 s)
// would make that most of this test's time. It goes in as README's
// `make run CONFIG=FILE`.
const probeConfig = `version: v1
configs:
  default:
    health:
      probeInterval: 1s
`

// TestReadmeQuickStart runs README's Quick start as a new user does: `make
// run` for real (the Makefile's own recipe, on a free port and a temp
// RUN_DIR), then every command of its sh blocks in order through sh, with
// ./bin/gpu-agent this test's build and localhost:9400 that port. Each command
// must succeed and show what README's comment on it promises; a command the
// test does not know fails it, so a README edit cannot go untested. Then what
// the section's prose offers: `make clean-run` starts over, and `make run
// CONFIG=FILE` with the MPS example serves healthy replicas through the
// stand-in daemons, which `make clean-run` stops; and it starts with every
// GPU healthy though the first run ended on a fault, as clean-run promises.
func TestReadmeQuickStart(t *testing.T) {
	if _, err := exec.LookPath("curl"); err != nil {
		t.Fatal("the Quick start uses curl, which is not on PATH (Debian: apt-get install curl)")
	}
	var cmds []string // with their comments, which say what to expect
	for _, line := range readmeShLines(t, "## Quick start") {
		if !strings.HasPrefix(line, "#") { // a comment continuing the line above
			cmds = append(cmds, line)
		}
	}
	if len(cmds) < 10 {
		t.Fatalf("README's Quick start has %d commands in sh blocks: %q", len(cmds), cmds)
	}
	// Unix socket paths are limited to 108 bytes: keep the root short.
	root, err := os.MkdirTemp("", "gaq")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	q := &quickStart{t: t, runDir: filepath.Join(root, "run"), addr: freeAddr(t)}
	t.Cleanup(q.cleanUp)
	probe := filepath.Join(root, "probe.yaml")
	if err := os.WriteFile(probe, []byte(probeConfig), 0o644); err != nil {
		t.Fatal(err)
	}

	for _, line := range cmds {
		q.step(line, probe)
	}
	if q.agent == nil {
		t.Fatal("the Quick start never runs `make run`")
	}
	// "watch `gpu-agent status` mark the GPU unhealthy and bring it back":
	// whatever the faults, the section leaves every GPU healthy.
	q.waitStatus("every GPU healthy after the Quick start's faults", allHealthy)
	// A fault the next run would restore but for `make clean-run`: the MPS
	// run below finds every GPU healthy only if it starts over.
	resp, err := http.Post("http://"+q.addr+"/sim/xid", "application/json", strings.NewReader(`{"gpu":1,"xid":79}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	q.waitStatus("GPU 1 unhealthy before make clean-run", func(out string) bool {
		return strings.HasPrefix(deviceHealth(out)[1], "unhealthy: XID 79")
	})
	q.stop()
	q.cleanRun()

	// `make run CONFIG=FILE` with the MPS example's config, as
	// docs/simulator.md writes it out.
	mpsConfig := filepath.Join(root, "mps.yaml")
	if err := os.WriteFile(mpsConfig, loadExample(t, repoPath("deploy", "examples", "mps-x2.yaml")), 0o644); err != nil {
		t.Fatal(err)
	}
	q.start(mpsConfig)
	q.waitStatus("16 healthy MPS replicas", func(out string) bool {
		return regexp.MustCompile(`(?m)^nvidia\.com/gpu\.mps\s+16\s+16\s`).MatchString(out)
	})
	// The limits each client gets, as the example sets them, on every GPU.
	q.waitStatus("each GPU's MPS limits", func(out string) bool {
		rows := regexp.MustCompile(`(?m)^GPU-\S+\s+\d\s+nvidia\.com/gpu\.mps\s+mps\s+2\s+threads 50%, memory 0=20480M\s`)
		return len(rows.FindAllString(out, -1)) == quickStartGPUs
	})
	if len(q.daemons()) != quickStartGPUs {
		t.Errorf("%d stand-in MPS daemons run, want one per GPU (%d)", len(q.daemons()), quickStartGPUs)
	}
	q.stop()
	if len(q.daemons()) != quickStartGPUs {
		t.Errorf("%d stand-in MPS daemons outlive the agent, want %d: as real ones, they do", len(q.daemons()), quickStartGPUs)
	}
	q.cleanRun()
	if pids := q.daemons(); len(pids) != 0 {
		t.Errorf("make clean-run left stand-in MPS daemons running: pids %v", pids)
	}
}

// quickStart is one run through the Quick start: the agent `make run`
// started, and where.
type quickStart struct {
	t        *testing.T
	runDir   string // RUN_DIR
	addr     string // host:port the agent listens on, for localhost:9400
	agent    *exec.Cmd
	agentLog *syncBuffer
	done     chan struct{} // closed once make run has exited
}

// step runs one README command line and checks what its comment promises.
func (q *quickStart) step(line, probe string) {
	t := q.t
	t.Helper()
	args := shellWords(line)
	t.Logf("$ %s", line)
	switch {
	case slices.Equal(args, []string{"make", "run"}):
		q.start(probe)
		return
	case slices.Equal(args, []string{"make", "test"}):
		return // what runs this test; running it here would recurse
	case len(args) > 0 && args[0] == "./bin/gpu-agent":
		q.checkAgentCommand(line, args[1:], q.sh(line))
	case len(args) > 0 && args[0] == "curl":
		q.checkCurl(line, args, q.sh(line))
	default:
		t.Fatalf("README Quick start command %q: the test does not know how to run it", line)
	}
}

// sh runs a README line through sh in the repository, as typed, with this
// test's binary and port (GPU_AGENT_ADDR for `gpu-agent status`, which
// defaults to port 9400); it must succeed.
func (q *quickStart) sh(line string) string {
	t := q.t
	t.Helper()
	if q.agent == nil {
		t.Fatalf("%s: runs before `make run`", line)
	}
	typed := strings.NewReplacer("./bin/gpu-agent", agentBin, "localhost:9400", q.addr).Replace(line)
	cmd := exec.Command("sh", "-c", typed)
	cmd.Dir = repoRoot
	cmd.Env = append(quickStartEnv(), "GPU_AGENT_ADDR=http://"+q.addr)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", line, err, out)
	}
	return string(out)
}

var (
	reVersion   = regexp.MustCompile(`^gpu-agent \S+ \(commit \S*, go1\.\d+[^)]*\)\n$`)
	reMIGOffers = regexp.MustCompile(`(?m)^nvidia\.com/mig-\dg\.\d+gb\s+\d+\s`)
	reMIGCreate = regexp.MustCompile(`(?m)^\s+\d+\. create \dg\.\d+gb at \d\+\d$`)
)

// checkAgentCommand checks the output of a ./bin/gpu-agent command line.
func (q *quickStart) checkAgentCommand(line string, args []string, out string) {
	t := q.t
	t.Helper()
	sub := strings.Join(args[:min(2, len(args))], " ")
	switch {
	case slices.Equal(args, []string{"status"}):
		for _, want := range []*regexp.Regexp{
			regexp.MustCompile(`(?m)^Backend:\s+sim:dgx-a100,`),
			regexp.MustCompile(`(?m)^Agent:\s+gpu-agent \S+ \(commit`),
			regexp.MustCompile(fmt.Sprintf(`(?m)^nvidia\.com/gpu\s+%d\s+%[1]d\s+not registered`, quickStartGPUs)),
		} {
			if !want.MatchString(out) {
				t.Errorf("%s: no line matching %s in:\n%s", line, want, out)
			}
		}
	case slices.Equal(args, []string{"version"}):
		if !reVersion.MatchString(out) {
			t.Errorf("%s: %q, want gpu-agent VERSION (commit C, goX)", line, out)
		}
	case sub == "config validate" && slices.Contains(args, "--addr"):
		// "what that layout would make of this node": its MIG resources.
		if !strings.Contains(out, ": valid (") || !reMIGOffers.MatchString(out) {
			t.Errorf("%s: want the file valid and the MIG resources the node would offer:\n%s", line, out)
		}
	case sub == "mig plan" && slices.Contains(args, "--addr"):
		// "and the steps, GPU by GPU".
		if n := strings.Count(out, "\nGPU "); n < quickStartGPUs-1 || !reMIGCreate.MatchString(out) {
			t.Errorf("%s: want create steps for every GPU:\n%s", line, out)
		}
	default:
		t.Fatalf("README Quick start command %q: the test does not know what it should show", line)
	}
}

// checkCurl checks a curl line's answer and, for the fault injections, that
// `gpu-agent status` then shows what the line's comment says.
func (q *quickStart) checkCurl(line string, args []string, out string) {
	t := q.t
	t.Helper()
	req, err := parseCurl(args)
	if err != nil {
		t.Fatalf("README Quick start command %q: %v", line, err)
	}
	switch {
	case req.method == "GET" && req.path == "/status":
		var st struct {
			Backend string `json:"backend"`
			Build   struct {
				Version string `json:"version"`
			} `json:"build"`
			GPUs []json.RawMessage `json:"gpus"`
		}
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("%s: not JSON: %v\n%s", line, err, out)
		}
		if !strings.HasPrefix(st.Backend, "sim:dgx-a100") || st.Build.Version == "" || len(st.GPUs) != quickStartGPUs {
			t.Errorf("%s: backend %q, build version %q, %d GPUs; want sim:dgx-a100, a version, %d",
				line, st.Backend, st.Build.Version, len(st.GPUs), quickStartGPUs)
		}
	case req.method == "GET" && req.path == "/metrics" && req.grep == "gpu_agent_":
		if !regexp.MustCompile(`(?m)^gpu_agent_build_info\{.*\} 1$`).MatchString(out) {
			t.Errorf("%s: no gpu_agent_build_info in:\n%s", line, out)
		}
	case req.method == "POST" && strings.HasPrefix(req.path, "/sim/"):
		if strings.TrimSpace(out) != `{"ok":true}` {
			t.Fatalf("%s: answered %q", line, out)
		}
		q.checkFault(line, req)
	default:
		t.Fatalf("README Quick start command %q: the test does not know what it should show", line)
	}
}

// checkFault waits until `gpu-agent status` shows what an injection's
// comment promises: an XID makes the GPU unhealthy with the cause the
// comment names, a reset brings that GPU back, a reboot every GPU.
func (q *quickStart) checkFault(line string, req curlRequest) {
	t := q.t
	t.Helper()
	var body struct {
		GPU *int `json:"gpu"`
		XID int  `json:"xid"`
	}
	if req.data != "" {
		if err := json.Unmarshal([]byte(req.data), &body); err != nil {
			t.Fatalf("%s: -d %s: %v", line, req.data, err)
		}
	}
	_, comment, _ := strings.Cut(line, "#")
	comment, _, _ = strings.Cut(strings.TrimSpace(comment), ":")
	switch {
	case req.path == "/sim/xid" && body.GPU != nil && body.XID > 0 && comment != "":
		want := fmt.Sprintf("unhealthy: XID %d (", body.XID)
		q.waitStatus(fmt.Sprintf("GPU %d %s... %s", *body.GPU, want, comment), func(out string) bool {
			h := deviceHealth(out)[*body.GPU]
			return strings.HasPrefix(h, want) && strings.Contains(h, comment)
		})
	case req.path == "/sim/reset" && body.GPU != nil:
		q.waitStatus(fmt.Sprintf("GPU %d healthy", *body.GPU), func(out string) bool {
			return deviceHealth(out)[*body.GPU] == "healthy"
		})
	case req.path == "/sim/reboot" && req.data == "":
		q.waitStatus("every GPU healthy", allHealthy)
	default:
		t.Fatalf("README Quick start command %q: the test does not know what it should do", line)
	}
}

// allHealthy: every GPU's row says healthy.
func allHealthy(status string) bool {
	h := deviceHealth(status)
	for _, health := range h {
		if health != "healthy" {
			return false
		}
	}
	return len(h) == quickStartGPUs
}

// reDeviceRow is a whole GPU's row of the status table's device list:
// resource, device, GPU, NUMA, held by, health.
var reDeviceRow = regexp.MustCompile(`(?m)^nvidia\.com/gpu\s+GPU-[0-9a-f-]+\s+(\d+)\s+\S+\s+\S+\s+(.+)$`)

// deviceHealth is the HEALTH column of each GPU's row, by GPU index.
func deviceHealth(status string) map[int]string {
	h := map[int]string{}
	for _, m := range reDeviceRow.FindAllStringSubmatch(status, -1) {
		var idx int
		fmt.Sscan(m[1], &idx)
		h[idx] = strings.TrimSpace(m[2])
	}
	return h
}

// waitStatus runs `gpu-agent status` until ok accepts its output: the agent
// turns a fault into health on its next event or probe.
func (q *quickStart) waitStatus(what string, ok func(string) bool) {
	t := q.t
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var out []byte
	for time.Now().Before(deadline) {
		var err error
		out, err = exec.Command(agentBin, "status", "--addr", q.addr).CombinedOutput()
		if err == nil && ok(string(out)) {
			return
		}
		select {
		case <-q.done:
			t.Fatalf("waiting for %s: make run exited:\n%s", what, q.agentLog)
		case <-time.After(200 * time.Millisecond):
		}
	}
	t.Fatalf("gpu-agent status did not come to show %s within 30s:\n%s", what, out)
}

// start runs `make run CONFIG=config` as README's user does, with the
// Makefile's recipe but this test's binary (-o build: TestMain built it),
// run directory and port; it returns once the agent answers `gpu-agent
// status` with the node's GPUs.
func (q *quickStart) start(config string) {
	t := q.t
	t.Helper()
	abs, err := filepath.Abs(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("make", "-C", abs, "--no-print-directory", "-o", "build", "run",
		"BIN="+agentBin, "RUN_DIR="+q.runDir, "LISTEN="+q.addr, "CONFIG="+config)
	cmd.Env = quickStartEnv()
	q.agentLog = &syncBuffer{}
	cmd.Stdout, cmd.Stderr = q.agentLog, q.agentLog
	// Its own process group, so that stop interrupts make and the agent as
	// Ctrl-C in the user's terminal does.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	q.agent, q.done = cmd, make(chan struct{})
	go func(done chan struct{}) { _ = cmd.Wait(); close(done) }(q.done)
	q.waitStatus(fmt.Sprintf("%d GPUs", quickStartGPUs), func(out string) bool {
		return len(deviceHealth(out)) == quickStartGPUs ||
			regexp.MustCompile(`(?m)^nvidia\.com/gpu\.mps\s`).MatchString(out)
	})
}

// stop interrupts make run and waits for the agent to exit.
func (q *quickStart) stop() {
	t := q.t
	t.Helper()
	if q.agent == nil {
		return
	}
	_ = syscall.Kill(-q.agent.Process.Pid, syscall.SIGINT)
	select {
	case <-q.done:
	case <-time.After(20 * time.Second):
		_ = syscall.Kill(-q.agent.Process.Pid, syscall.SIGKILL)
		<-q.done
		t.Errorf("make run did not stop within 20s of Ctrl-C:\n%s", q.agentLog)
	}
	if !strings.Contains(q.agentLog.String(), "gpu-agent stopped") {
		t.Errorf("the agent did not stop cleanly on Ctrl-C:\n%s", q.agentLog)
	}
	q.agent = nil
}

// cleanRun runs `make clean-run`, which must leave nothing of the run.
func (q *quickStart) cleanRun() {
	t := q.t
	t.Helper()
	abs, err := filepath.Abs(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("make", "-C", abs, "--no-print-directory", "clean-run", "BIN="+agentBin, "RUN_DIR="+q.runDir)
	cmd.Env = quickStartEnv()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make clean-run: %v\n%s", err, out)
	}
	if _, err := os.Stat(q.runDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("make clean-run left %s (%v)", q.runDir, err)
	}
}

// cleanUp stops what a failed run left: the agent, then the stand-in MPS
// daemons (started by this test's binary, so none is another's).
func (q *quickStart) cleanUp() {
	q.stop()
	for _, pid := range q.daemons() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// daemons are the pids of the stand-in MPS daemons of this test's binary.
func (q *quickStart) daemons() []int {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	var pids []int
	for _, p := range procs {
		data, err := os.ReadFile(p)
		if err != nil {
			continue // exited meanwhile
		}
		args := strings.Split(strings.TrimRight(string(data), "\x00"), "\x00")
		if slices.Equal(args, []string{agentBin, "mps-control-sim", "--daemon"}) {
			var pid int
			fmt.Sscan(filepath.Base(filepath.Dir(p)), &pid)
			pids = append(pids, pid)
		}
	}
	return pids
}

// quickStartEnv is this environment without what would change make's or the
// agent's behaviour from a new user's: the outer make's flags (make
// deploy-test runs this test) and gpu-agent's own variables.
func quickStartEnv() []string {
	return slices.DeleteFunc(os.Environ(), func(kv string) bool {
		name, _, _ := strings.Cut(kv, "=")
		return slices.Contains([]string{"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "NODE_NAME", "KUBECONFIG"}, name) ||
			strings.HasPrefix(name, "GPU_AGENT_") || strings.HasPrefix(name, "CUDA_MPS_")
	})
}

// curlRequest is what a README curl line asks.
type curlRequest struct {
	method, path, data string
	grep               string // the pattern of a `| grep PATTERN` after it
}

// parseCurl reads the curl options README uses (-s, -XPOST, -d) and the
// URL on localhost:9400, and one `| grep PATTERN`; anything else is an error,
// so that a README change the test does not follow fails it.
func parseCurl(args []string) (curlRequest, error) {
	r := curlRequest{method: "GET"}
	if i := slices.Index(args, "|"); i >= 0 {
		if len(args) != i+3 || args[i+1] != "grep" {
			return r, fmt.Errorf("pipe into %q: want | grep PATTERN", args[i+1:])
		}
		r.grep, args = args[i+2], args[:i]
	}
	var url string
	for i := 1; i < len(args); i++ {
		switch a := args[i]; {
		case a == "-s":
		case strings.HasPrefix(a, "-X"):
			r.method = strings.TrimPrefix(a, "-X")
		case a == "-d" && i+1 < len(args):
			i++
			r.data = args[i]
		case !strings.HasPrefix(a, "-") && url == "":
			url = a
		default:
			return r, fmt.Errorf("curl argument %q not understood", a)
		}
	}
	path, ok := strings.CutPrefix(url, "localhost:9400")
	if !ok || !strings.HasPrefix(path, "/") {
		return r, fmt.Errorf("URL %q: want localhost:9400/PATH, where make run listens", url)
	}
	if r.data != "" && r.method == "GET" {
		r.method = "POST" // as curl does with -d
	}
	r.path = path
	return r, nil
}

// shellWords splits a command line as sh does for README's lines: words
// separated by blanks, '...' quoting, a | on its own, a # comment dropped.
func shellWords(line string) []string {
	var words []string
	var cur strings.Builder
	inWord, quoted := false, false
	flush := func() {
		if inWord {
			words = append(words, cur.String())
			cur.Reset()
			inWord = false
		}
	}
	for _, c := range line {
		switch {
		case quoted && c == '\'':
			quoted = false
		case quoted:
			cur.WriteRune(c)
		case c == '\'':
			quoted, inWord = true, true
		case c == '#' && !inWord:
			flush()
			return words
		case c == ' ' || c == '\t':
			flush()
		case c == '|':
			flush()
			words = append(words, "|")
		default:
			cur.WriteRune(c)
			inWord = true
		}
	}
	flush()
	return words
}

// freeAddr is a loopback address nothing listens on now: port 9400 may be
// another `make run`'s on this machine.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// syncBuffer is make run's output, written by exec's copier while the test
// reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
