// The attention explorer: an image in, the prediction over it, and for a clicked pixel p the
// map each PSA branch predicts at p (collect: where p gathers from; distribute: where p sends
// to) over the image, in JET from blue (the map's min) to red (its max). Talks to the server
// that serves this page: GET /v1/model, POST /v1/explore, GET /v1/explore/{id}?x=&y=. A
// server with --auth_token_file takes its token from the address: /explorer/#token=<token>.
'use strict';

const TITLES = {collect: 'collect: where p gathers from',
                distribute: 'distribute: where p sends to'};
const WHICH = {collect: 'column p of the collect map', distribute: 'row p of the distribute map'};
const state = {model: null, image: null, point: null, maps: null, scale: 1};
window.explorer = state;  // read by tests/test_serve_page.py

const $ = (selector) => document.querySelector(selector);
const TOKEN = new URLSearchParams(location.hash.slice(1)).get('token');

// fetch with the bearer token of the page's address, if any.
function request(url, options = {}) {
  const headers = {...(options.headers || {})};
  if (TOKEN) headers.Authorization = `Bearer ${TOKEN}`;
  return fetch(url, {...options, headers});
}

function setState(name, message) {
  document.body.dataset.state = name;
  if (message !== undefined) $('#status').textContent = message;
}

// JET as 0..255 -> [r, g, b]: the piecewise-linear ramp blue, cyan, yellow, red.
function jet(value) {
  const t = value / 255;
  const channel = (centre) => Math.round(255 * Math.min(1, Math.max(0, 1.5 - Math.abs(4 * t - centre))));
  return [channel(3), channel(2), channel(1)];
}

function bytes(base64) {
  const text = atob(base64);
  const out = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
  return out;
}

async function errorOf(response) {
  try { return (await response.json()).error; } catch (e) { return response.statusText; }
}

function paint(canvas, width, height, values, colour) {
  canvas.width = width;
  canvas.height = height;
  const context = canvas.getContext('2d');
  const pixels = context.createImageData(width, height);
  for (let i = 0; i < values.length; i++) {
    const [r, g, b] = colour(values[i]);
    pixels.data.set([r, g, b, 255], 4 * i);
  }
  context.putImageData(pixels, 0, 0);
}

function sizeStack(stack, width, height) {
  for (const canvas of stack.querySelectorAll('canvas')) {
    canvas.style.width = `${width * state.scale}px`;
    canvas.style.height = `${height * state.scale}px`;
  }
  const marker = stack.querySelector('.marker');
  marker.width = Math.round(width * state.scale);
  marker.height = Math.round(height * state.scale);
}

function drawMarkers() {
  for (const marker of document.querySelectorAll('.marker')) {
    const context = marker.getContext('2d');
    context.clearRect(0, 0, marker.width, marker.height);
    if (!state.point) continue;
    const x = (state.point.x + 0.5) * state.scale, y = (state.point.y + 0.5) * state.scale;
    for (const [colour, width] of [['black', 4], ['white', 2]]) {
      context.strokeStyle = colour;
      context.lineWidth = width;
      context.beginPath();
      context.arc(x, y, 7, 0, 2 * Math.PI);
      context.moveTo(x - 14, y); context.lineTo(x + 14, y);
      context.moveTo(x, y - 14); context.lineTo(x, y + 14);
      context.stroke();
    }
  }
}

function drawLegend(counts) {
  const total = Object.values(counts).reduce((a, b) => a + b, 0);
  const legend = $('#legend');
  legend.replaceChildren();
  const classes = Object.keys(counts).map(Number).sort((a, b) => counts[b] - counts[a]);
  for (const id of classes) {
    const info = state.model.classes[id] || {name: `class ${id}`, color: state.model.palette[id]};
    const item = document.createElement('li');
    const swatch = document.createElement('span');
    swatch.className = 'swatch';
    swatch.style.background = `rgb(${info.color.join(',')})`;
    item.append(swatch, `${info.name} ${(100 * counts[id] / total).toFixed(1)}%`);
    legend.append(item);
  }
}

function imagePixel(event, stack) {
  const box = stack.getBoundingClientRect();
  const clamp = (v, n) => Math.min(n - 1, Math.max(0, Math.floor(v)));
  return {x: clamp((event.clientX - box.left) * state.image.width / box.width, state.image.width),
          y: clamp((event.clientY - box.top) * state.image.height / box.height, state.image.height)};
}

async function showPoint(point) {
  state.point = point;
  drawMarkers();
  setState('point-loading', `p = (${point.x}, ${point.y}): reading its attention…`);
  const response = await request(`/v1/explore/${state.image.id}?x=${point.x}&y=${point.y}`);
  if (!response.ok) { setState('error', `error: ${await errorOf(response)}`); return; }
  const answer = await response.json();
  if (state.point !== point) return;  // another click came first
  state.maps = answer.maps;
  const { width, height } = state.image;
  for (const map of answer.maps) {
    const figure = document.querySelector(`.map[data-direction="${map.direction}"]`);
    paint(figure.querySelector('.heat'), width, height, bytes(map.values), jet);
    figure.querySelector('.which').textContent =
      `${WHICH[map.direction]}; p in map cell (row ${map.cell[0]}, col ${map.cell[1]}) of ` +
      `${map.map_size[0]}x${map.map_size[1]}`;
    figure.querySelector('.low').textContent = map.min.toPrecision(2);
    figure.querySelector('.high').textContent = map.max.toPrecision(2);
  }
  $('#point').textContent = `p = (${point.x}, ${point.y})`;
  setState('point-shown', `p = (${point.x}, ${point.y}); click another pixel to move it.`);
}

function buildMaps(branches, bitmap) {
  const maps = $('#maps');
  maps.replaceChildren();
  for (const branch of branches) {
    const figure = $('#map-template').content.firstElementChild.cloneNode(true);
    figure.dataset.direction = branch.direction;
    figure.querySelector('.title').textContent = TITLES[branch.direction];
    figure.querySelector('.which').textContent = 'click a pixel';
    const grey = figure.querySelector('.grey');
    grey.width = bitmap.width;
    grey.height = bitmap.height;
    grey.getContext('2d').drawImage(bitmap, 0, 0);
    paint(figure.querySelector('.bar'), 256, 1, Uint8Array.from({length: 256}, (_, i) => i), jet);
    const stack = figure.querySelector('.stack');
    sizeStack(stack, bitmap.width, bitmap.height);
    stack.addEventListener('click', (event) => showPoint(imagePixel(event, stack)));
    maps.append(figure);
  }
}

async function explore(file) {
  if (!state.model || !state.model.explorer) return;
  setState('uploading', `running the model on ${file.name}…`);
  state.point = state.maps = null;
  $('#point').textContent = '';
  const response = await request('/v1/explore', {method: 'POST', body: file,
    headers: {'Content-Type': file.type || 'application/octet-stream'}});
  if (!response.ok) { setState('error', `error: ${await errorOf(response)}`); return; }
  const answer = await response.json();
  const bitmap = await createImageBitmap(file, {imageOrientation: 'from-image'});
  const { width, height } = answer;
  state.image = answer;
  state.scale = width < 384 ? Math.ceil(384 / width) : Math.min(1, 640 / width);
  const image = $('#image');
  image.width = width;
  image.height = height;
  image.getContext('2d').drawImage(bitmap, 0, 0);
  const palette = state.model.palette;
  paint($('#label'), width, height, bytes(answer.label), (id) => palette[id] || [0, 0, 0]);
  sizeStack($('#prediction'), width, height);
  drawLegend(answer.counts);
  buildMaps(answer.branches, bitmap);
  drawMarkers();
  $('#figures').hidden = false;
  setState('predicted', `${file.name}: ${width}x${height}; click any pixel.`);
}

async function start() {
  const response = await request('/v1/model');
  if (response.status === 401) {
    const note = $('#unavailable');
    note.textContent = `This server needs its token (${await errorOf(response)}): open ` +
      `${location.origin}/explorer/#token=<token>, the token of its --auth_token_file.`;
    note.hidden = false;
    $('#file').disabled = true;
    setState('unauthorized');
    return;
  }
  if (!response.ok) { setState('error', `error: ${await errorOf(response)}`); return; }
  state.model = await response.json();
  $('#model').textContent = `${state.model.source} (${state.model.backend}), ` +
    `${state.model.num_classes || '?'} classes`;
  if (!state.model.explorer) {
    const note = $('#unavailable');
    note.textContent = 'The explorer needs the model: this server runs an export, which ' +
      'keeps no attention to read. Start the server with the training config and weights: ' +
      'python serve.py --config <training config> --model_path <model.pdparams>.';
    note.hidden = false;
    $('#file').disabled = true;
    setState('unavailable');
    return;
  }
  const drop = $('#drop');
  $('#file').addEventListener('change', (event) => event.target.files[0] && explore(event.target.files[0]));
  drop.addEventListener('dragover', (event) => { event.preventDefault(); drop.classList.add('over'); });
  drop.addEventListener('dragleave', () => drop.classList.remove('over'));
  drop.addEventListener('drop', (event) => {
    event.preventDefault();
    drop.classList.remove('over');
    if (event.dataTransfer.files[0]) explore(event.dataTransfer.files[0]);
  });
  $('#prediction').addEventListener('click', (event) => state.image &&
    showPoint(imagePixel(event, $('#prediction'))));
  setState('ready', 'drop or choose an image');
}

start().catch((error) => setState('error', `error: ${error}`));
