// Command scrape-storm runs `gpu-agent run` on a simulated node and storms
// its /metrics with many fast scrapers while a kubelet-like liveness probe
// asks /healthz, and prints what each side got: the figures of issue 23
// (defect 6), where the probes lost to the scrapers.
//
//	go build -o /tmp/gpu-agent ./cmd/gpu-agent   # at the repository root
//	cd test/bench && go run ./cmd/scrape-storm -agent /tmp/gpu-agent
//
// Every scraper asks once per -interval, all of them on the same tick (a
// storm, not a spread-out crowd), on a fresh connection unless -keepalive.
// The probe, like the kubelet's, opens a fresh connection every
// -probe-every and fails unless /healthz answers 200 within -probe-timeout
// (the chart's timeoutSeconds); the chart restarts the agent after
// -failure-threshold failures in a row.
//
// The agent, the prober and the scrapers are three processes, as on a node
// (where the scrapers are not even on the same machine): in one process
// the prober's goroutine would queue behind the scrapers' and time its own
// starvation. The scrapers run at nice -scrapers-nice, so that on a small
// machine they take the CPU the agent and the kubelet leave, rather than
// half of it; 0 runs them at the agent's priority.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/gpu-agent/gpu-agent/test/bench/internal/proc"
)

type options struct {
	agent, backend   string
	scrapers         int
	duration         time.Duration
	interval         time.Duration
	scrapeTimeout    time.Duration
	keepAlive        bool
	scrapersNice     int
	probeEvery       time.Duration
	probeTimeout     time.Duration
	failureThreshold int
	// The roles this command runs itself in.
	probeOnly, scrapeOnly string
}

func main() {
	var o options
	flag.StringVar(&o.agent, "agent", "/tmp/gpu-agent", "gpu-agent binary")
	flag.StringVar(&o.backend, "backend", "sim:dgx-a100", "backend, without its state file (one is added)")
	flag.IntVar(&o.scrapers, "scrapers", 500, "concurrent scrapers")
	flag.DurationVar(&o.duration, "duration", 25*time.Second, "how long the storm lasts")
	flag.DurationVar(&o.interval, "interval", time.Second, "each scraper asks once per interval")
	flag.DurationVar(&o.scrapeTimeout, "scrape-timeout", 10*time.Second, "a scrape's timeout (Prometheus' default)")
	flag.BoolVar(&o.keepAlive, "keepalive", false, "scrapers keep their connection between scrapes, as Prometheus does")
	flag.IntVar(&o.scrapersNice, "scrapers-nice", 19, "niceness of the scrapers' process (0: the agent's)")
	flag.DurationVar(&o.probeEvery, "probe-every", 1400*time.Millisecond, "liveness probe period")
	flag.DurationVar(&o.probeTimeout, "probe-timeout", time.Second, "liveness probe timeout (the chart's timeoutSeconds)")
	flag.IntVar(&o.failureThreshold, "failure-threshold", 3, "probe failures in a row that restart the agent (the chart's failureThreshold)")
	flag.StringVar(&o.probeOnly, "probe-only", "", "only probe this URL for -duration and print the tally as JSON (the prober's role)")
	flag.StringVar(&o.scrapeOnly, "scrape-only", "", "only scrape this URL for -duration and print the tally as JSON (the scrapers' role)")
	flag.Parse()
	var err error
	switch {
	case o.probeOnly != "":
		err = printJSON(probe(o.probeOnly, o))
	case o.scrapeOnly != "":
		if err = raiseFileLimit(o.scrapers + 100); err == nil {
			err = printJSON(storm(o.scrapeOnly, o))
		}
	default:
		err = run(o)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "scrape-storm:", err)
		os.Exit(1)
	}
}

func run(o options) error {
	dir, err := os.MkdirTemp("", "scrape-storm-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	for _, d := range []string{"dp", "state", "mps"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return err
		}
	}
	logf, err := os.Create(filepath.Join(dir, "agent.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(o.agent, "run", "--backend", o.backend+",state="+filepath.Join(dir, "sim-state.json"),
		"--device-plugin-dir", filepath.Join(dir, "dp"), "--pod-resources-socket", filepath.Join(dir, "pr.sock"),
		"--state-dir", filepath.Join(dir, "state"), "--mps-root", filepath.Join(dir, "mps"),
		"--listen", "127.0.0.1:0", "--log-format", "json")
	cmd.Stdout = logf
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	defer stop(cmd)
	addr, err := listenAddr(stderr, logf)
	if err != nil {
		return err
	}
	base := "http://" + addr
	if err := waitSampled(base, 60*time.Second); err != nil {
		return err
	}
	fmt.Printf("agent %s on %s: %d scrapers (nice %d) of /metrics every %v for %v (keep-alive %v), /healthz probe every %v with timeout %v\n",
		o.agent, addr, o.scrapers, o.scrapersNice, o.interval, o.duration, o.keepAlive, o.probeEvery, o.probeTimeout)

	cpu0, err := proc.CPUTime(cmd.Process.Pid)
	if err != nil {
		return err
	}
	var probes probeTally
	var scrapes scrapeTally
	var probeErr, scrapeErr error
	var wg sync.WaitGroup
	wg.Go(func() { probeErr = runRole(0, &probes, "-probe-only", base+"/healthz", o) })
	wg.Go(func() { scrapeErr = runRole(o.scrapersNice, &scrapes, "-scrape-only", base+"/metrics", o) })
	wg.Wait()
	if err := errors.Join(probeErr, scrapeErr); err != nil {
		return err
	}
	cpu1, err := proc.CPUTime(cmd.Process.Pid)
	if err != nil {
		return err
	}
	report(o, scrapes, probes, cpu1-cpu0)
	return nil
}

// runRole runs this command in a role (flag url) at niceness nice, and
// decodes what it prints into tally.
func runRole(nice int, tally any, flag, url string, o options) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	args := []string{flag, url, "-duration", o.duration.String(),
		"-scrapers", strconv.Itoa(o.scrapers), "-interval", o.interval.String(),
		"-scrape-timeout", o.scrapeTimeout.String(), "-keepalive=" + strconv.FormatBool(o.keepAlive),
		"-probe-every", o.probeEvery.String(), "-probe-timeout", o.probeTimeout.String()}
	cmd := exec.Command(self, args...)
	if nice != 0 {
		cmd = exec.Command("nice", append([]string{"-n", strconv.Itoa(nice), self}, args...)...)
	}
	cmd.Stderr = os.Stderr
	var out strings.Builder
	cmd.Stdout = &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w", flag, err)
	}
	return json.Unmarshal([]byte(out.String()), tally)
}

func printJSON(v any) error { return json.NewEncoder(os.Stdout).Encode(v) }

// scrapeTally counts how one or more scrapers' requests ended.
type scrapeTally struct {
	Requests, OK int
	Status       map[int]int // answers other than 200
	Reset        int         // ECONNRESET or EPIPE: the agent closed with the request unread
	Closed       int         // EOF before any answer: a hang-up without a reset
	Timeout      int
	Other        map[string]int
	Worst        time.Duration // the slowest answered scrape
}

func (t *scrapeTally) add(u scrapeTally) {
	t.Requests += u.Requests
	t.OK += u.OK
	t.Reset += u.Reset
	t.Closed += u.Closed
	t.Timeout += u.Timeout
	t.Worst = max(t.Worst, u.Worst)
	for k, v := range u.Status {
		if t.Status == nil {
			t.Status = map[int]int{}
		}
		t.Status[k] += v
	}
	for k, v := range u.Other {
		if t.Other == nil {
			t.Other = map[string]int{}
		}
		t.Other[k] += v
	}
}

// storm runs o.scrapers scrapers of url for o.duration.
func storm(url string, o options) scrapeTally {
	ctx, cancel := context.WithTimeout(context.Background(), o.duration)
	defer cancel()
	results := make([]scrapeTally, o.scrapers)
	start := time.Now()
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() { results[i] = scrape(ctx, url, start, o) })
	}
	wg.Wait()
	var total scrapeTally
	for _, r := range results {
		total.add(r)
	}
	return total
}

// scrape asks url on every tick of o.interval from start until ctx ends;
// a tick that comes while a scrape is still running is skipped, as
// Prometheus skips it.
func scrape(ctx context.Context, url string, start time.Time, o options) scrapeTally {
	var t scrapeTally
	client := &http.Client{
		Transport: &http.Transport{DisableKeepAlives: !o.keepAlive, MaxIdleConnsPerHost: 1},
		Timeout:   o.scrapeTimeout,
	}
	defer client.CloseIdleConnections()
	for next := start; ; {
		if wait := time.Until(next); wait > 0 {
			select {
			case <-ctx.Done():
				return t
			case <-time.After(wait):
			}
		}
		if ctx.Err() != nil {
			return t
		}
		t.Requests++
		began := time.Now()
		code, err := get(client, url)
		switch {
		case err == nil && code == http.StatusOK:
			t.OK++
			t.Worst = max(t.Worst, time.Since(began))
		case err == nil:
			if t.Status == nil {
				t.Status = map[int]int{}
			}
			t.Status[code]++
			t.Worst = max(t.Worst, time.Since(began))
		case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
			t.Reset++
		case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
			// net/http's name for an EOF on a connection it thought reusable.
			strings.Contains(err.Error(), "server closed idle connection"):
			t.Closed++
		case isTimeout(err):
			t.Timeout++
		default:
			if t.Other == nil {
				t.Other = map[string]int{}
			}
			t.Other[err.Error()]++
		}
		for !next.After(time.Now()) {
			next = next.Add(o.interval)
		}
	}
}

func get(client *http.Client, url string) (int, error) {
	resp, err := client.Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return 0, err
	}
	return resp.StatusCode, nil
}

func isTimeout(err error) bool {
	var te interface{ Timeout() bool }
	return errors.As(err, &te) && te.Timeout()
}

type probeTally struct {
	OK, Failed, WorstRun int
	Worst                time.Duration // the slowest probe answered in time
	Failures             []string      // why each failed, in order
}

// probe asks url every o.probeEvery for o.duration, each time on a fresh
// connection, as the kubelet does.
func probe(url string, o options) probeTally {
	ctx, cancel := context.WithTimeout(context.Background(), o.duration)
	defer cancel()
	var t probeTally
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: o.probeTimeout}
	tick := time.NewTicker(o.probeEvery)
	defer tick.Stop()
	run := 0
	for first := true; ; first = false {
		if !first {
			select {
			case <-ctx.Done():
				return t
			case <-tick.C:
			}
		}
		began := time.Now()
		code, err := get(client, url)
		took := time.Since(began)
		if err == nil && code == http.StatusOK {
			t.OK++
			t.Worst = max(t.Worst, took)
			run = 0
			continue
		}
		t.Failed++
		run++
		t.WorstRun = max(t.WorstRun, run)
		why := fmt.Sprint("status ", code)
		if err != nil {
			why = err.Error()
		}
		t.Failures = append(t.Failures, fmt.Sprintf("after %v: %s", took.Round(time.Millisecond), why))
	}
}

func report(o options, s scrapeTally, p probeTally, agentCPU time.Duration) {
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	nonOK := 0
	var codes []string
	for code, n := range s.Status {
		nonOK += n
		codes = append(codes, fmt.Sprintf("%d×%d", n, code))
	}
	sort.Strings(codes)
	other := 0
	var others []string
	for e, n := range s.Other {
		other += n
		others = append(others, fmt.Sprintf("%d× %s", n, e))
	}
	sort.Strings(others)
	fmt.Fprintf(tw, "scrapes\t%d\n", s.Requests)
	fmt.Fprintf(tw, "  200\t%d\n", s.OK)
	fmt.Fprintf(tw, "  non-200\t%d\t%s\n", nonOK, strings.Join(codes, " "))
	fmt.Fprintf(tw, "  reset\t%d\t(ECONNRESET/EPIPE)\n", s.Reset)
	fmt.Fprintf(tw, "  closed unanswered\t%d\t(EOF)\n", s.Closed)
	fmt.Fprintf(tw, "  timed out\t%d\t(after %v)\n", s.Timeout, o.scrapeTimeout)
	fmt.Fprintf(tw, "  other errors\t%d\t%s\n", other, strings.Join(others, "; "))
	fmt.Fprintf(tw, "  slowest answer\t%v\n", s.Worst.Round(time.Millisecond))
	fmt.Fprintf(tw, "probes\t%d\n", p.OK+p.Failed)
	fmt.Fprintf(tw, "  ok\t%d\t(slowest %v)\n", p.OK, p.Worst.Round(time.Millisecond))
	fmt.Fprintf(tw, "  failed\t%d\n", p.Failed)
	restart := ""
	if p.WorstRun >= o.failureThreshold {
		restart = fmt.Sprintf("(>= failureThreshold %d: the kubelet restarts the agent)", o.failureThreshold)
	}
	fmt.Fprintf(tw, "  worst run of failures\t%d\t%s\n", p.WorstRun, restart)
	fmt.Fprintf(tw, "agent CPU\t%v\t(user+system during the storm)\n", agentCPU.Round(10*time.Millisecond))
	tw.Flush()
	for _, f := range p.Failures {
		fmt.Println("  probe failed", f)
	}
}

// listenAddr reads the agent's JSON log until it says where it listens,
// copying every line to log.
func listenAddr(stderr io.Reader, log io.Writer) (string, error) {
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		fmt.Fprintln(log, sc.Text())
		var line struct {
			Msg    string `json:"msg"`
			Listen string `json:"listen"`
		}
		if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "gpu-agent starting" && line.Listen != "" {
			go func() { _, _ = io.Copy(log, stderr) }()
			return line.Listen, nil
		}
	}
	return "", fmt.Errorf("the agent exited before it listened (%v)", sc.Err())
}

// waitSampled polls base until /healthz answers 200 and /metrics has the
// DCGM series: the agent has read its GPUs and sampled them, so a scrape
// has its full size. (/readyz stays 503 here: there is no kubelet to
// register with.)
func waitSampled(base string, bound time.Duration) error {
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(bound)
	for {
		code, err := get(client, base+"/healthz")
		if err == nil && code == http.StatusOK {
			var body []byte
			var resp *http.Response
			if resp, err = client.Get(base + "/metrics"); err == nil {
				body, err = io.ReadAll(resp.Body)
				resp.Body.Close()
				if err == nil && strings.Contains(string(body), "DCGM_FI_") {
					return nil
				}
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: no /healthz and DCGM series within %v (last: %d %v)", base, bound, code, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func stop(cmd *exec.Cmd) {
	_ = cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// raiseFileLimit lets this process hold a connection per scraper.
func raiseFileLimit(want int) error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return err
	}
	if lim.Cur >= uint64(want) {
		return nil
	}
	if lim.Max < uint64(want) {
		return fmt.Errorf("RLIMIT_NOFILE hard limit %d is below the %d descriptors %d scrapers need", lim.Max, want, want-100)
	}
	lim.Cur = uint64(want)
	return syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
}
